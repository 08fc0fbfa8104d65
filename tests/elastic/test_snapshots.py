"""The in-memory snapshot tier in one process: the header's wire format, which snapshot a resume takes
(a table), how often snapshots are taken (a table), a torn, damaged or stale snapshot never offered, the
state after step s exactly (while the next step computes), a writer killed at random moments, and the
agent's directory (created, swept, removed)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import (
    BLANK,
    HEADER_SIZE,
    SnapshotHeader,
    snapshot_path,
    stale_reason,
)
from petctl.elastic import Checkpointer, State
from petctl.elastic.snapshots import SnapshotOptions, SnapshotTier
from petctl.elastic.snapshots.resume import Offer, SnapshotReader, newest_common
from petctl.elastic.snapshots.writer import Cadence, SnapshotWriter
from petctl.io.snapshotfiles import read_header
from tests.support.checkpointing import Recorder
from tests.support.paths import REPO
from tests.support.snapshot_states import assert_same, frozen, make_state, read_back, train

HEADER = SnapshotHeader(job="train", round=3, step=41, rank=2, world_size=3, data_length=128, meta_offset=128,
                        meta_length=50, checksum=0xDEADBEEF, written_at=1.5)


# --- the header ---------------------------------------------------------------------------------------
def test_header_round_trips_and_fills_its_slot() -> None:
    data = HEADER.pack()
    assert len(data) == HEADER_SIZE
    assert SnapshotHeader.unpack(data) == HEADER
    assert HEADER.payload_length == 178


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: BLANK, "no committed snapshot"),  # zeroed before a write: never loaded
    (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "damaged"),  # one bit of the step flipped
    (lambda b: b[:100] + bytes(HEADER_SIZE - 100), "damaged"),  # cut off while the header was written
    (lambda b: b"NOTSNAP\x00" + b[8:], "no committed snapshot"),
    (lambda b: b[:10], "too short"),
])
def test_a_damaged_header_is_refused(damage, message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        SnapshotHeader.unpack(damage(HEADER.pack()))


def test_another_format_version_is_refused() -> None:
    import dataclasses

    with pytest.raises(WireFormatError, match="version 2"):
        SnapshotHeader.unpack(dataclasses.replace(HEADER, version=2).pack())


@pytest.mark.parametrize(("job", "current", "stale"), [
    ("train", 4, None),  # written by the round before: loadable
    ("train", 9, None),  # several rounds back: still this job's history (the newest step decides)
    ("train", 3, "round 3"),  # written in this very round: not by a predecessor
    ("train", 2, "round 3"),  # from the future: another run's file
    ("other", 4, "job 'train'"),  # a job of the same name earlier on this node, or another job
])
def test_stale_snapshots_are_named(job: str, current: int, stale: str | None) -> None:
    reason = stale_reason(HEADER, job, current)
    assert (reason is None) if stale is None else (stale in reason)


# --- which snapshot the job takes ------------------------------------------------------------------------
def O(rank: int, step: int, *parts: int) -> Offer:  # noqa: E743, N802
    return Offer(rank, step, frozenset(parts or (0,)))


@pytest.mark.parametrize(("offers", "parts", "store", "source", "step", "holders"), [
    ([], {0}, None, "none", None, {}),  # nothing anywhere: a fresh start
    ([], {0}, 19, "store", None, {}),  # no snapshot: the store
    ([O(1, 25), O(2, 25)], {0}, 19, "snapshot", 25, {0: 1}),  # DDP survivors: the lowest rank sends it
    ([O(2, 24), O(1, 25)], {0}, 19, "snapshot", 25, {0: 1}),  # one rank a step ahead: the newest
    ([O(1, 19)], {0}, 19, "snapshot", 19, {0: 1}),  # a tie with the store: memory, no download
    ([O(1, 12)], {0}, 19, "store", None, {}),  # the store is newer (a rejoining node's old snapshot)
    ([O(0, 7)], {0}, None, "snapshot", 7, {0: 0}),  # nothing in the store yet
    # sharded: a step counts only when every shard is held by someone (own copy or a peer's)
    ([O(0, 9, 0), O(1, 9, 1), O(2, 9, 2)], {0, 1, 2}, 4, "snapshot", 9, {0: 0, 1: 1, 2: 2}),
    ([O(0, 9, 0, 2), O(1, 9, 1, 0)], {0, 1, 2}, 4, "snapshot", 9, {0: 0, 1: 1, 2: 0}),  # node 2 lost
    ([O(0, 9, 0), O(1, 9, 1)], {0, 1, 2}, 4, "store", None, {}),  # shard 2 lost with its peer copy
    ([O(0, 9, 0, 1), O(1, 8, 1, 0), O(0, 8, 0)], {0, 1}, 4, "snapshot", 9, {0: 0, 1: 0}),
    ([O(0, 9, 0), O(1, 8, 1), O(0, 8, 0)], {0, 1}, 4, "snapshot", 8, {0: 0, 1: 1}),  # newest common: 8
])
def test_the_newest_step_covering_every_part_is_taken(offers, parts, store, source, step, holders) -> None:
    choice = newest_common(offers, frozenset(parts), store)
    assert (choice.source, choice.step, choice.holder_of) == (source, step, holders), choice.reason
    assert choice.reason


def test_a_snapshot_the_store_beat_is_named() -> None:
    """The node-loss tests tell "the store was newer than a whole snapshot" (a loss covered by memory
    all the same) from "no snapshot was whole" by this field."""
    assert newest_common([O(1, 12)], store_step=19).passed_over == 12
    assert newest_common([O(0, 9, 0)], frozenset({0, 1}), 4).passed_over is None  # none whole
    assert newest_common([O(1, 25)], store_step=19).passed_over is None  # memory won


# --- the payload checksum ---------------------------------------------------------------------------
def test_the_payload_checksum_catches_a_flipped_bit_and_a_moved_block() -> None:
    from petctl.elastic.snapshots.codec import CHECK_BLOCK, payload_checksum

    block = 8 * CHECK_BLOCK
    data = bytearray(random.Random(3).randbytes(3 * block + 1000))  # three whole blocks and a tail
    good = payload_checksum(data, 0, len(data))
    for where in (0, block + 17, 3 * block - 1, 3 * block + 999):  # each block, and the tail
        bad = bytearray(data)
        bad[where] ^= 0x40
        assert payload_checksum(bad, 0, len(bad)) != good, where
    moved = data[block:2 * block] + data[:block] + data[2 * block:]  # two blocks swapped
    assert payload_checksum(bytearray(moved), 0, len(moved)) != good
    assert payload_checksum(data, 8, len(data) - 8) != good  # another range


# --- how often -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fixed", "costs", "step", "every"), [
    (None, [0.0004] * 5, 0.1, 1),  # 0.4 ms on a 100 ms step: every step
    (None, [0.0009] * 5, 0.01, 1),  # under 1 ms: every step, even on a 10 ms step
    (None, [0.004] * 5, 0.1, 4),  # 4 ms: every 4th step keeps it at 1 %
    (None, [0.0004, 0.0004, 0.05, 0.0004, 0.0004], 0.1, 1),  # one slow snapshot moves nothing
    (None, [0.05] * 5 + [0.0004] * 9, 0.1, 1),  # back to every step once the cost falls
    (None, [0.05] * 4, 0.1, 1),  # the first snapshots pay one-time costs: no verdict before 5
    (3, [0.05] * 5, 0.1, 3),  # a fixed K is kept
])
def test_k_follows_the_measured_cost(fixed, costs, step: float, every: int) -> None:
    cadence = Cadence(fixed=fixed, budget=0.01)
    now = 0.0
    for cost in costs:
        now += step
        cadence.step_ended(now)
        cadence.record(cost)
    assert cadence.every == every


def test_a_snapshot_is_due_every_k_step_ends() -> None:
    cadence = Cadence(fixed=3)
    due = []
    for i in range(7):
        if cadence.step_ended(float(i)):
            due.append(i)
            cadence.started()
    assert due == [0, 3, 6]


# --- writing and reading ---------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False], ids=["background_copy", "copy_at_step_end"])
def test_a_snapshot_holds_the_state_after_its_step_while_the_next_step_runs(
        tmp_path: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy of parameters and optimizer state runs beside the next step; the optimizer's pre-hook
    holds that step's update until it is done, and the buffers the next forward changes are copied at
    the step end. So the snapshot is exactly the state after its step, every time."""
    commit = SnapshotWriter._commit

    def late_commit(self, *args):  # the background copy starts after the next step's forward
        time.sleep(0.05)
        return commit(self, *args)

    monkeypatch.setattr(SnapshotWriter, "_commit", late_commit)
    width = 1024  # 25 MB: copied in the background (not inline)
    state, rec = make_state(width=width), Recorder()
    writer = SnapshotWriter(tmp_path / "state.snap", "job", 1, 0, 1, rec.log, every=1, overlap=overlap)
    for step in range(6):
        train(state, step, width)
        expected = frozen(state)
        writer.take(step, state)
        train(state, step + 100, width)  # the next step: forward (buffers), backward, optimizer.step
        writer._finish()
        header, got = read_back(tmp_path / "state.snap")
        assert header.step == step
        assert_same(expected, got)
    writer.close()
    assert rec.events("snapshot.stats")[0]["snapshots"] == 6
    # 6 parameters, and AdamW's step, exp_avg and exp_avg_sq of each: copied in the background
    assert rec.events("snapshot.enabled")[0]["background"] == (24 if overlap else 0)
    assert (rec.events("snapshot.stats")[0]["hook_wait_ms"] > 0) == overlap  # the next step did wait


def test_a_change_of_k_is_announced_once_the_snapshot_it_follows_is_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`snapshot.every` is a bound a loss oracle reads. Said when the cadence chose a lower K, it promised
    too much: the snapshot the new K follows was still being written, and a loss then cost the old K.
    Here the cadence lowers K at step 2, whose commit the test holds in the background: the event comes
    only once step 2's snapshot is committed."""
    commit, release, committed = SnapshotWriter._commit, threading.Event(), [-1]

    def late_commit(self, header, *args):
        if header.step == 2:
            assert release.wait(60), "the test never released step 2's commit"
        commit(self, header, *args)
        committed.append(header.step)

    monkeypatch.setattr(SnapshotWriter, "_commit", late_commit)
    width = 1024  # 25 MB: committed in the background (not inline)
    state, rec = make_state(width=width), Recorder()
    writer = SnapshotWriter(tmp_path / "state.snap", "job", 1, 0, 1, rec.log, every=1)

    def lowered_at_step_2(*_args, **_kwargs) -> tuple[int, int, float, float] | None:
        return (1, 3, 0.01, 0.1) if writer.taken == 2 else None  # (every, was, cost, step time)

    monkeypatch.setattr(writer.cadence, "record", lowered_at_step_2)
    said: list[tuple[int, int]] = []
    emit = rec.log.emit

    def recording(event: str, **fields) -> None:
        if event == "snapshot.every":  # the newest committed step as it is said (the file itself may
            said.append((fields["step"], committed[-1]))  # be mid-write of the next snapshot by then)
        emit(event, **fields)

    monkeypatch.setattr(rec.log, "emit", recording)
    for step in range(4):
        train(state, step, width)
        writer.take(step, state)
        if step == 2:
            assert said == [], said  # step 2's snapshot is still being written
            release.set()
    writer.close()
    assert said == [(2, 2)], said  # said once step 2's snapshot was committed
    assert rec.events("snapshot.every")[0]["every"] == 1


def test_a_small_state_is_snapshotted_from_the_rounds_first_step_however_late_the_background_thread(
        tmp_path: Path) -> None:
    """A restart maps the file for the state (`prepare`) so the first snapshot need not. A small state is
    mapped at once: were it left to the niced background thread, a starved host could keep it pending
    for steps, every due snapshot meanwhile skipped, and a loss would then cost more than K (one way to
    the 2 steps a CI soak once redid after a worker crash). The thread is held here for the whole round;
    every step is still kept."""
    state, rec = make_state(), Recorder()
    writer = SnapshotWriter(tmp_path / "state.snap", "job", 1, 0, 1, rec.log)  # auto cadence: skips
    held = threading.Event()
    writer._pool.submit(held.wait)  # the background thread does not run before the round ends
    try:
        writer.prepare(state)
        for step in range(3):
            train(state, step)
            assert writer.take(step, state), f"step {step}'s snapshot skipped"
            assert read_back(tmp_path / "state.snap")[0].step == step
    finally:
        held.set()
        writer.close()


def test_a_torn_damaged_or_stale_snapshot_is_never_offered(tmp_path: Path) -> None:
    state, rec = make_state(), Recorder()
    path = tmp_path / "state.snap"
    writer = SnapshotWriter(path, "job", 2, 0, 1, rec.log, every=1)
    train(state, 0)
    writer.take(0, state)
    writer.close()
    good = path.read_bytes()

    def offer(job: str = "job", round_no: int = 3) -> Offer | None:
        return SnapshotReader(path, job, round_no, 0, rec.log).offer()

    assert offer() == Offer(0, 0)
    path.write_bytes(BLANK + good[HEADER_SIZE:])  # a writer killed mid-copy: the header was blanked
    assert offer() is None
    flipped = bytearray(good)
    flipped[HEADER_SIZE + 7] ^= 0x10  # a bit of a weight changed after the commit
    path.write_bytes(bytes(flipped))
    assert offer() is None
    path.write_bytes(good[:HEADER_SIZE + 10])  # truncated
    assert offer() is None
    path.write_bytes(good)
    assert offer(round_no=2) is None  # written in this round
    assert offer(job="other") is None  # another job's
    reasons = [e["reason"] for e in rec.events("snapshot.skipped")]
    assert [r.split(" ")[0] for r in reasons] == ["no", "checksum", "snapshot", "stale:", "stale:"], reasons
    path.unlink()
    assert offer() is None  # no file: nothing to say
    assert len(rec.events("snapshot.skipped")) == 5


# One process imports torch once, then forks a writer per attempt (as the agent's fork server forks warm
# workers: no thread and no tensor op before the fork): a writer announces `ready PID` after 3 steps, or
# `committed PID` once it has committed the snapshot of `hold` and waits to die; the parent reaps each
# writer the test kills and says `reaped`.
WRITER_LOOP = r'''
import os, sys, torch
from pathlib import Path
from petctl.io.eventlog import EventLog
from petctl.elastic import State
from petctl.elastic.snapshots.writer import SnapshotWriter


def write(path, overlap, hold_at):
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model=model, optimizer=opt, extra={"step": -1})
    writer = SnapshotWriter(path, "job", 1, 0, 1, EventLog("t", stream=open("/dev/null", "w")), every=1,
                            overlap=overlap)
    for step in range(10**6):
        model.weight.grad = torch.zeros_like(model.weight)
        model.bias.grad = torch.zeros_like(model.bias)
        opt.step()
        with torch.no_grad():
            for t in (model.weight, model.bias, *[s["momentum_buffer"] for s in opt.state.values()]):
                t.fill_(step)
        state.extra["step"] = step
        writer.take(step, state)
        if step == hold_at:
            writer.close()  # commits the snapshot in flight
            print("committed", os.getpid(), flush=True)
            import time
            time.sleep(3600)
        if step == 2 and hold_at < 0:
            print("ready", os.getpid(), flush=True)


for line in sys.stdin:
    path, overlap, hold_at = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            write(Path(path), overlap == "1", int(hold_at))  # until killed
        finally:
            os._exit(1)  # never back into the parent's loop
    os.waitpid(pid, 0)
    print("reaped", flush=True)
'''


@pytest.mark.slow  # one process importing torch, forking a writer per attempt
@pytest.mark.timeout(600)
@pytest.mark.parametrize("overlap", [True, False], ids=["background_copy", "copy_at_step_end"])
def test_a_writer_killed_at_any_moment_leaves_a_whole_snapshot_or_none(tmp_path: Path, overlap: bool) -> None:
    """SIGKILL a process writing 8 MB snapshots back to back, at random moments: what is left is either
    no snapshot or one whose every value is its step's (never a mix of two steps)."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER_LOOP)
    rng = random.Random(16)
    outcomes = {"whole": 0, "none": 0}
    parent = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdin is not None and parent.stdout is not None
    try:
        # 8 kills at random moments (most land mid-write, which must leave no snapshot), then one right
        # after a commit, so the whole-snapshot check runs on every machine, however loaded.
        for attempt in range(9):
            path = tmp_path / f"state-{attempt}.snap"
            held = attempt == 8
            parent.stdin.write(f"{path} {1 if overlap else 0} {5 if held else -1}\n")
            parent.stdin.flush()
            said, pid = parent.stdout.readline().split()
            assert said == ("committed" if held else "ready")
            if not held:
                time.sleep(rng.uniform(0, 0.05))
            os.kill(int(pid), signal.SIGKILL)
            assert parent.stdout.readline().strip() == "reaped"
            offered = SnapshotReader(path, "job", 2, 0, Recorder().log).offer()
            if offered is None:
                assert not held, "a committed snapshot was not offered"
                outcomes["none"] += 1
                continue
            header, got = read_back(path)
            values = {float(v) for t in (got["model"]["weight"], got["model"]["bias"]) for v in t.unique()}
            momenta = {float(v) for s in got["optimizer"]["state"].values()
                       for v in s["momentum_buffer"].unique()}
            assert values == momenta == {float(header.step)} and got["extra"]["step"] == header.step
            assert not held or header.step == 5
            outcomes["whole"] += 1
    finally:
        parent.stdin.close()
        parent.kill()
        parent.wait()
    assert outcomes["whole"] >= 1, outcomes  # the check above ran


def test_checkpointer_resumes_from_the_newer_of_snapshot_and_store(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One process: a snapshot newer than the store wins; a store newer than the snapshot wins; a job of
    another name, or PETCTL_SNAPSHOTS=0, never sees the snapshot."""
    monkeypatch.setenv("PETCTL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PETCTL_CONTROL_DIR", raising=False)
    monkeypatch.setenv("PETCTL_SNAPSHOT_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("PETCTL_JOB", "job")
    (tmp_path / "shm").mkdir()
    url = (tmp_path / "ckpt").as_uri()

    def run(round_no: int, steps: range, **kw) -> tuple[int, State, dict, Recorder]:
        monkeypatch.setenv("PETCTL_ROUND", str(round_no))
        state, rec = make_state(seed=round_no), Recorder()
        kw.setdefault("snapshots", SnapshotOptions(every=1))  # K fixed: these steps last milliseconds
        ckpt = Checkpointer(url=url, every=5, background=False, log=rec.log, **kw)
        start = ckpt.resume(state)
        for step in steps:
            train(state, step)
            ckpt.step_end(step, state)
        after = frozen(state)
        ckpt.close()
        return start, state, after, rec

    _, _, after_7, _ = run(1, range(0, 8))  # store: step 4; snapshot: step 7
    start, state, _, rec = run(2, range(0))
    assert start == 8 and rec.events("checkpoint.resumed")[0]["source"] == "snapshot"
    assert_same(after_7, frozen(state))
    # Snapshots off for a round that saves step 9 to the store: the snapshot (step 7) is now older.
    run(3, range(8, 10), snapshots=False)
    start, _, _, rec = run(4, range(0))
    assert start == 10 and rec.events("checkpoint.resumed")[0]["source"] in ("cache", "store")
    assert rec.events("snapshot.passed_over")[0]["reason"].startswith("store step 9 is newer")
    monkeypatch.setenv("PETCTL_SNAPSHOTS", "0")
    start, _, _, rec = run(5, range(0))
    assert start == 10 and not rec.events("snapshot.skipped") and not rec.events("snapshot.passed_over")
    monkeypatch.delenv("PETCTL_SNAPSHOTS")
    monkeypatch.setenv("PETCTL_JOB", "another")
    start, _, _, rec = run(6, range(0))
    assert start == 10 and "job 'job'" in rec.events("snapshot.skipped")[0]["reason"]


class Opaque:
    """Not plain data: a weights-only loader must refuse it."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.mark.parametrize(("weights_only", "opaque"), [(True, True), (False, True), (True, False)])
def test_a_skeleton_the_safe_loader_refuses_falls_back_to_the_store(tmp_path: Path, weights_only: bool,
                                                                   opaque: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain data, dtypes, sizes and devices come back weights-only; an arbitrary object only with
    weights_only=False, else the snapshot is reported unloadable and the store is used."""
    monkeypatch.setenv("PETCTL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PETCTL_CONTROL_DIR", raising=False)
    monkeypatch.setenv("PETCTL_JOB", "job")
    url, opts = (tmp_path / "ckpt").as_uri(), SnapshotOptions(every=1, directory=str(tmp_path))
    state = make_state()
    state.extra.update(dtype=torch.float16, size=torch.Size([2, 3]), device=torch.device("cpu"))
    if opaque:
        state.extra["obj"] = Opaque(7)
    monkeypatch.setenv("PETCTL_ROUND", "1")
    ckpt = Checkpointer(url=url, log=Recorder().log, snapshots=opts, weights_only=False)
    train(state, 0)
    ckpt.step_end(0, state)
    ckpt.close()
    monkeypatch.setenv("PETCTL_ROUND", "2")
    fresh, rec = make_state(seed=5), Recorder()
    ckpt = Checkpointer(url=url, log=rec.log, snapshots=opts, weights_only=weights_only)
    start = ckpt.resume(fresh)
    ckpt.close()
    if weights_only and opaque:
        assert start == 0 and "Opaque is not allowed" in rec.events("snapshot.load_failed")[0]["error"]
    else:
        assert start == 1 and (not opaque or fresh.extra["obj"].value == 7)
        assert (fresh.extra["dtype"], fresh.extra["size"]) == (torch.float16, torch.Size([2, 3]))


def test_snapshot_options_are_checked(tmp_path: Path) -> None:
    from petctl.elastic.dist import Comm

    with pytest.raises(ValueError, match="no directory"):
        SnapshotTier(Comm(), Recorder().log, SnapshotOptions(enabled=True), environ={})
    with pytest.raises(ValueError, match="every"):
        SnapshotTier(Comm(), Recorder().log, SnapshotOptions(every=0), environ={})
    off = SnapshotTier(Comm(), Recorder().log, None, environ={})
    assert off.writer is None and not off.exchange  # outside the agent, alone: nothing at all
    other_rank = SnapshotTier(Comm(local_rank=1), Recorder().log, None,
                              environ={"PETCTL_SNAPSHOT_DIR": str(tmp_path)})
    assert other_rank.writer is None and other_rank.reader is None  # one copy per node: local rank 0
    assert snapshot_path(tmp_path, "state") == tmp_path / "state.snap"


def test_a_full_tmpfs_disables_snapshots_and_training_goes_on(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    state, rec = make_state(), Recorder()
    writer = SnapshotWriter(tmp_path / "state.snap", "job", 1, 0, 1, rec.log, every=1)
    for step in range(3):
        train(state, step)
        writer.take(step, state)
    writer.close()
    (disabled,) = rec.events("snapshot.disabled")
    assert disabled["step"] == 0 and "No space" in disabled["reason"]
    assert not (tmp_path / "state.snap").exists() or read_header_fails(tmp_path / "state.snap")


def read_header_fails(path: Path) -> bool:
    try:
        read_header(path)
    except (OSError, WireFormatError):
        return True
    return False
