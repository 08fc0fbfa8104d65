"""Sharded in-memory snapshots, the fast parts: which save a resume takes (a table over the offers), and
a shard file as a reader sees it (committed whole or not at all; stale, damaged or torn never loaded)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import HEADER_SIZE
from petctl.elastic.snapshots.codec import (
    assemble,
    commit,
    encode,
    pack,
    read_verified,
    stage,
    unpack,
    verify,
)
from petctl.elastic.snapshots.resume import ShardOffer, choose_shards
from petctl.elastic.snapshots.ring import detach_for_capture


def held(rank: int, old: int, step: int = 10, round_no: int = 1, world: int = 3,
         kind: str = "own") -> ShardOffer:
    return ShardOffer(rank, old, step, round_no, world, 100 + old, kind)


def ring(world: int, lost: set[int], step: int = 10, round_no: int = 1) -> list[ShardOffer]:
    """What the survivors offer after a save of `world` ranks (one per node) when nodes `lost` are gone:
    each survivor its own shard and the previous node's copy. New ranks: the survivors in order."""
    alive = [n for n in range(world) if n not in lost]
    offers = []
    for new, node in enumerate(alive):
        offers += [held(new, node, step, round_no, world),
                   held(new, (node - 1) % world, step, round_no, world, "peer")]
    return offers


@pytest.mark.parametrize("lost", [set(), {0}, {1}, {2}])
def test_any_one_node_lost_is_covered(lost: set[int]) -> None:
    choice = choose_shards(ring(3, lost), store_step=5)
    assert (choice.source, choice.save, choice.missing) == ("snapshot", (1, 10, 3), ())
    assert [old for old, _rank, _size in choice.holders] == [0, 1, 2]
    assert {old: size for old, _rank, size in choice.holders} == {0: 100, 1: 101, 2: 102}


@pytest.mark.parametrize(("lost", "missing"), [({0, 1}, (0,)), ({1, 2}, (1,)), ({2, 0}, (2,)),
                                               ({0, 1, 2}, None)])
def test_two_neighbours_lost_at_once_fall_back_to_the_store_naming_the_missing(lost, missing) -> None:
    choice = choose_shards(ring(3, lost), store_step=5)
    assert choice.source == "store"
    if missing is None:  # nobody left to offer anything
        assert choice.reason == "no rank offered a shard snapshot"
    else:
        assert choice.missing == missing and "lost at once" in choice.reason


def test_two_losses_apart_are_covered_on_a_ring_of_four() -> None:
    assert choose_shards(ring(4, {0, 2}), store_step=None).source == "snapshot"
    assert choose_shards(ring(4, {1, 2}), store_step=None).missing == (1,)


def test_the_store_wins_when_newer_a_tie_goes_to_memory_and_nothing_anywhere_is_none() -> None:
    beaten = choose_shards(ring(3, {1}, step=10), store_step=11)
    assert (beaten.source, beaten.passed_over, beaten.store_step) == ("store", 10, 11)
    assert choose_shards(ring(3, {0, 1}), store_step=4).passed_over is None  # nothing whole to beat
    assert choose_shards(ring(3, {1}, step=10), store_step=10).source == "snapshot"
    assert choose_shards([], store_step=None).source == "none"
    assert choose_shards(ring(3, {0, 1}), store_step=None).source == "none"


def test_a_kill_mid_commit_leaves_the_older_save_whole() -> None:
    """Ranks 0 and 1 committed step 11 (own and peer), rank 2 was killed before its commit: it still
    held step 10, and its step-11 shard is on node 0 (received before anyone committed)."""
    offers = [held(0, 0, 11), held(0, 2, 11, kind="peer"), held(1, 1, 11), held(1, 0, 11, kind="peer")]
    choice = choose_shards(offers, store_step=0)
    assert (choice.source, choice.step) == ("snapshot", 11)
    mixed = [held(0, 0, 11), held(0, 2, 10, kind="peer"), held(1, 1, 10), held(1, 0, 10, kind="peer"),
             held(1, 2, 11, kind="peer")]  # step 11: old ranks 0 and 2 only; step 10 whole
    choice = choose_shards(mixed, store_step=0)
    assert (choice.step, choice.missing) == (10, (1,)) and "lacks old ranks [1]" in choice.reason


def test_a_kill_while_the_ranks_agree_to_commit_leaves_the_save_before_whole() -> None:
    """An all-reduce that ended on one rank has not ended on all (an e2e run under load: rank 2's node
    killed while the ring agreed to commit step 50, so rank 0 committed it and rank 1 did not). Rank 0
    holds step 11's shards 0 and 2, rank 1 step 10's shards 1 and 0: no save is whole from the newest
    files alone, and the job fell back to the store, 11 steps older. Rank 0 also kept the save before
    its commit (`ring.exchange`), so step 10 is whole: one save's steps lost, as docs/elastic.md says."""
    newest_only = [held(0, 0, 11), held(0, 2, 11, kind="peer"), held(1, 1, 10), held(1, 0, 10, kind="peer")]
    assert choose_shards(newest_only, store_step=0).source == "store"  # what the e2e run hit
    kept = [held(0, 0, 10, kind="own-before"), held(0, 2, 10, kind="peer-before")]
    choice = choose_shards(newest_only + kept, store_step=0)
    assert (choice.source, choice.step, choice.missing) == ("snapshot", 10, (1,))
    assert {old: rank for old, rank, _size in choice.holders} == {0: 0, 1: 1, 2: 0}


class _Ring:
    """One rank's view of a ring whose other ranks all agree with it (each maximum is this rank's own
    value) until the `kill_at`-th agreement, which raises as gloo does when a neighbour is gone; `seen`
    records the shard files at each agreement."""

    has_peer = True

    def __init__(self, directory: Path, kill_at: int | None = None) -> None:
        self.directory, self.kill_at, self.calls, self.seen = directory, kill_at, 0, []

    def all_max(self, *values: int) -> tuple[int, ...]:
        self.calls += 1
        self.seen.append(sorted(p.name for p in self.directory.glob("*.snap")))
        if self.calls == self.kill_at:
            raise RuntimeError("gloo: connection closed by peer")
        return values

    def swap(self, buf: bytearray) -> bytearray:
        return shard_bytes(step=read_header_step(buf))


def read_header_step(buf: bytearray) -> int:
    from petctl.core.snapshotrecord import SnapshotHeader

    return SnapshotHeader.unpack(bytes(buf[:HEADER_SIZE])).step


def test_exchange_keeps_the_save_before_until_every_rank_committed(tmp_path: Path) -> None:
    """The files on one rank through two saves: the save before is kept from the commit until every
    rank agreed it committed, then dropped; a kill during that agreement leaves both saves offered."""
    from petctl.elastic.snapshots.codec import SHARD_KINDS, shard_path
    from petctl.elastic.snapshots.resume import ShardReader
    from petctl.elastic.snapshots.ring import exchange
    from petctl.io.eventlog import EventLog

    paths = {kind: shard_path(tmp_path, kind, 0) for kind in SHARD_KINDS}
    ring = _Ring(tmp_path)
    assert exchange(ring, paths, shard_bytes(step=1), 1, None) == (None, 1)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-own-0.snap", "shard-peer-0.snap"]
    ring = _Ring(tmp_path)
    assert exchange(ring, paths, shard_bytes(step=2), 1, None) == (None, 1)  # type: ignore[arg-type]
    assert ring.seen[2] == ["shard-own-0.snap", "shard-own-before-0.snap", "shard-peer-0.snap",
                            "shard-peer-before-0.snap"]  # committed, the save before kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-own-0.snap", "shard-peer-0.snap"]
    with pytest.raises(RuntimeError, match="gloo"):
        exchange(_Ring(tmp_path, kill_at=3), paths, shard_bytes(step=3), 1, None)  # type: ignore[arg-type]
    offers = ShardReader(tmp_path, 0, 0, "job", 2, EventLog("test")).offers()
    assert sorted((o.kind, o.step) for o in offers) == [("own", 3), ("own-before", 2), ("peer", 3),
                                                        ("peer-before", 2)]
    with pytest.raises(RuntimeError, match="gloo"):  # killed while agreeing every rank staged: no commit
        exchange(_Ring(tmp_path, kill_at=2), paths, shard_bytes(step=4), 1, None)  # type: ignore[arg-type]
    assert read_verified(paths["own"], "job", 2)[0].step == 3


def test_saves_of_another_round_or_world_never_mix() -> None:
    offers = [held(0, 0, 10, round_no=1, world=3), held(0, 1, 10, round_no=2, world=2),
              held(1, 1, 10, round_no=1, world=3), held(1, 0, 10, round_no=2, world=2)]
    choice = choose_shards(offers, store_step=None)
    assert (choice.source, choice.save) == ("snapshot", (2, 10, 2))  # round 1's lacks old rank 2
    assert choose_shards([held(0, 3, world=3)], None).source == "none"  # an old rank outside its world


def shard_bytes(step: int = 7, round_no: int = 1) -> bytearray:
    state = {"w": torch.arange(250, dtype=torch.float32), "extra": {"step": step}}
    return pack(*encode(detach_for_capture(state, overlap=False)), job="job", round_no=round_no, step=step,
                rank=2, world_size=3)


def test_a_shard_file_round_trips_and_names_its_save(tmp_path: Path) -> None:
    path = tmp_path / "shard-own-0.snap"
    commit(stage(path, shard_bytes()), path)
    header, buf = read_verified(path, "job", 2)
    assert (header.step, header.round, header.rank, header.world_size) == (7, 1, 2, 3)
    assert header.data_length == 1024  # 1000 bytes, aligned
    state = unpack(buf)
    assert torch.equal(state["w"], torch.arange(250, dtype=torch.float32)) and state["extra"] == {"step": 7}
    assert not list(tmp_path.glob("*.tmp"))


def test_a_staged_file_is_not_a_snapshot_until_committed(tmp_path: Path) -> None:
    path = tmp_path / "shard-own-0.snap"
    commit(stage(path, shard_bytes(step=7)), path)
    stage(path, shard_bytes(step=8))  # a writer killed before its commit
    assert read_verified(path, "job", 2)[0].step == 7


@pytest.mark.parametrize(("damage", "why"), [
    (lambda b: b.__setitem__(HEADER_SIZE + 5, b[HEADER_SIZE + 5] ^ 1), "checksum mismatch"),
    (lambda b: b.__delitem__(slice(len(b) - 10, None)), "header names"),
    (lambda b: b.__setitem__(slice(0, HEADER_SIZE), bytes(HEADER_SIZE)), "no committed snapshot"),
    (lambda b: b.__setitem__(40, b[40] ^ 1), "damaged"),
])
def test_damaged_or_torn_shards_are_refused(damage, why) -> None:
    buf = shard_bytes()
    damage(buf)
    with pytest.raises(WireFormatError, match=why):
        verify(buf, "job", 2)


def test_stale_shards_are_refused() -> None:
    with pytest.raises(WireFormatError, match="stale: written in round 2"):
        verify(shard_bytes(round_no=2), "job", 2)
    with pytest.raises(WireFormatError, match="stale: written by job"):
        verify(shard_bytes(), "other", 2)


def test_pieces_of_a_sharded_tensor_are_put_together_and_the_rest_comes_from_old_rank_0() -> None:
    """What each old rank's shard holds: its piece of each DTensor, and where that sits."""
    key = "__petctl_dtensor__"
    pieces = [{"w": {key: [torch.tensor([[1.0, 2.0]]), [3, 2], [0, 0]]}, "lr": 0.1},
              {"w": {key: [torch.tensor([[3.0, 4.0], [5.0, 6.0]]), [3, 2], [1, 0]]}, "lr": 0.1}]
    full = assemble(pieces)
    assert torch.equal(full["w"], torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])) and full["lr"] == 0.1
    with pytest.raises(ValueError, match="different keys"):
        assemble([{"a": 1}, {"b": 1}])


def test_one_process_snapshots_every_step_and_resumes_from_its_newest(tmp_path: Path) -> None:
    """No torch.distributed: the tier keeps its own shard only (no peer), the newest step, and a later
    round resumes from it, tensors and plain values alike; a later round of another job does not."""
    from petctl.elastic.dist import Comm
    from petctl.elastic.snapshots import SnapshotOptions
    from petctl.elastic.snapshots.ring import ShardSnapshotTier
    from petctl.io.eventlog import EventLog

    env = {"PETCTL_JOB": "job", "PETCTL_ROUND": "1"}
    opts = SnapshotOptions(every=1, directory=str(tmp_path))
    state = {"w": torch.zeros(3), "extra": {"step": -1}}
    tier = ShardSnapshotTier(Comm(), EventLog("test"), opts, env)
    for step in range(4):
        state["w"] += 1
        state["extra"]["step"] = step
        assert tier.take(step, state)
    tier.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-own-0.snap"]
    assert tier.report()["snapshots"] == 4 and tier.disabled is None

    back = {"w": torch.zeros(3), "extra": {"step": -1}}
    later = ShardSnapshotTier(Comm(), EventLog("test"), opts, {**env, "PETCTL_ROUND": "2"})
    assert later.resume(back, store_step=lambda: 1) == 3
    assert torch.equal(back["w"], torch.full((3,), 4.0)) and back["extra"] == {"step": 3}
    other = ShardSnapshotTier(Comm(), EventLog("test"), opts, {"PETCTL_JOB": "other", "PETCTL_ROUND": "2"})
    assert other.resume(back, store_step=lambda: None) is None  # another job's: stale


def test_a_lagging_ring_round_holds_the_next_step_so_a_finished_step_has_the_one_before_it_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine starves the ring thread. Before, training ran on while snapshot n's round was
    still exchanging, so a kill after step n+1 found only step n-1 whole: 2 steps redone where docs/elastic.md
    promises 1 (an e2e run under two busy loops redid steps 57-58). Now step n+1's `optimizer.step()`
    waits for that round: when a step is done, the step before it is committed, and the wait is counted
    as the snapshot's cost. The ring here takes 0.2 s a round; the steps take microseconds."""
    from petctl.elastic.dist import Comm
    from petctl.elastic.snapshots import SnapshotOptions
    from petctl.elastic.snapshots import ring as ring_module
    from petctl.elastic.snapshots.codec import read_verified, shard_path
    from petctl.elastic.snapshots.ring import ShardSnapshotTier
    from petctl.io.eventlog import EventLog

    real = ring_module.exchange

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(ring_module, "exchange", slow)
    env = {"PETCTL_JOB": "job", "PETCTL_ROUND": "1"}
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt, "extra": {"step": -1}}
    tier = ShardSnapshotTier(Comm(), EventLog("test"), SnapshotOptions(every=1, directory=str(tmp_path)), env)
    own = shard_path(tmp_path, "own", 0)
    committed = []
    for step in range(5):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        state["extra"]["step"] = step
        if step:  # step `step` is done: the snapshot of the step before it must be whole
            committed.append(read_verified(own, "job", 2)[0].step)  # as the next round reads it
        tier.take(step, state)
    tier.close()
    assert committed == [0, 1, 2, 3], committed
    assert tier.report()["hook_wait_ms"] >= 100  # the wait is the snapshot's cost, seen by the cadence


def test_a_change_of_the_agreed_k_is_announced_once_the_snapshot_it_follows_is_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`snapshot.every` says the K in force, and a loss oracle reads it as a bound. A lowering said when
    the ring agrees on it promised too much: the snapshot it follows was still in its round, and a kill
    then cost the old K (an e2e run redid 3 steps where the events said 1). Here the ring agrees on 3,
    then on 1, and takes 0.1 s a round: each change is announced only once the snapshot it follows is
    committed, with the K the steps then really have between snapshots."""
    from petctl.elastic.dist import Comm
    from petctl.elastic.snapshots import SnapshotOptions
    from petctl.elastic.snapshots import ring as ring_module
    from petctl.elastic.snapshots.codec import read_verified, shard_path
    from petctl.elastic.snapshots.ring import ShardSnapshotTier
    from petctl.io.eventlog import EventLog

    real, rounds = ring_module.exchange, []

    def agreeing(*args, **kwargs):
        time.sleep(0.1)
        failure, _k = real(*args, **kwargs)
        rounds.append(None)
        return failure, 3 if len(rounds) < 4 else 1  # rounds 1-3 agree on 3, later ones on 1

    monkeypatch.setattr(ring_module, "exchange", agreeing)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt, "extra": {"step": -1}}
    log = EventLog("test")
    tier = ShardSnapshotTier(Comm(), log, SnapshotOptions(every=1, directory=str(tmp_path)),
                             {"PETCTL_JOB": "job", "PETCTL_ROUND": "1"})
    own = shard_path(tmp_path, "own", 0)
    said, emit = [], log.emit

    def record(event: str, **fields) -> None:
        if event == "snapshot.every":  # what is whole on two nodes as it is said
            whole = read_verified(own, "job", 2)[0].step
            said.append((fields["step"], fields["every"], fields["was"], whole))
        emit(event, **fields)

    monkeypatch.setattr(log, "emit", record)
    taken = []
    for step in range(16):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        state["extra"]["step"] = step
        if tier.take(step, state):
            taken.append(step)
    tier.close()
    assert [(step, every, was) for step, every, was, _whole in said] == [(2, 3, 1), (11, 1, 3)], said
    assert all(whole >= step for step, _every, _was, whole in said), said
    assert taken[:6] == [0, 1, 2, 5, 8, 11] and taken[6:9] == [12, 13, 14], taken  # the K announced
