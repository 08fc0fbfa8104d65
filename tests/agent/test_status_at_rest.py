"""Issue 47, "nothing at rest": a node's status is put in etcd when what the node is changes, its
progress on a backoff, and nothing else; `petctl status` says how old a step it shows is.

Every put is a raft proposal. The agent used to put its status every 5 s whatever happened: two proposals
per node per 10 s at rest. The slow, end-to-end figure (etcd's own proposal counter over 60 s) is
tests/bench/test_rest_proposals.py; these are the decisions and the publisher on a fake store and clock.
"""

from __future__ import annotations

import dataclasses

from petctl.agent.decisions import RoundInfo
from petctl.agent.health import OutageReporter
from petctl.agent.rendezvous import RequestStats
from petctl.agent.reporting import (
    PROGRESS_FIRST,
    PROGRESS_MAX,
    REFRESH,
    STATUS_TTL,
    Progress,
    StatusPublisher,
    next_gap,
    status_due,
)
from petctl.cli.status import aged
from petctl.core.keys import JobKeys
from petctl.core.records import Checkpoint, NodeStatus
from petctl.core.store import StoreUnavailable
from tests.support.emitter import Recorder


def running(step: int | None = 10, **kw) -> NodeStatus:
    base = NodeStatus(node_id="a", state="running", updated=1.0, round=2, rank=0, world_size=3, restarts=0,
                      step=step, etcd_requests={"reads": 5, "writes": 3, "watches": 1})
    return dataclasses.replace(base, **kw)


def test_a_change_of_state_round_or_rank_is_put_at_once():
    put = running()
    for change in ({"state": "stopping"}, {"round": 3}, {"rank": 1}, {"world_size": 2}, {"restarts": 1},
                   {"failures": {"mirror": 1}}, {"last_error": ["Traceback"]}):
        assert status_due(put, running(**change), since_put=0.0, gap=PROGRESS_MAX) == "change", change
    assert status_due(None, put, since_put=0.0, gap=PROGRESS_FIRST) == "change"


def test_a_first_save_time_or_a_much_longer_one_is_put_at_once_a_similar_one_waits():
    """A noticed node of another rank plans its hand-off with rank 0's published save time."""
    def saved(step: int, save_s: float | None) -> NodeStatus:
        return running(step=step, last_checkpoint=Checkpoint(step=step, url="file:///c", save_s=save_s))

    assert status_due(running(), saved(20, 0.4), since_put=0.0, gap=PROGRESS_MAX) == "change"
    assert status_due(saved(20, 0.4), saved(40, 0.5), since_put=0.0, gap=PROGRESS_MAX) is None
    assert status_due(saved(20, 0.4), saved(40, 0.7), since_put=0.0, gap=PROGRESS_MAX) == "change"
    assert status_due(saved(20, 0.4), saved(40, None), since_put=0.0, gap=PROGRESS_MAX) is None


def test_progress_alone_waits_for_its_backoff():
    put = running(step=10)
    moved = running(step=11, updated=99.0, etcd_requests={"reads": 9, "writes": 3, "watches": 1})
    assert status_due(put, moved, since_put=4.9, gap=5.0) is None
    assert status_due(put, moved, since_put=5.0, gap=5.0) == "progress"
    assert status_due(put, moved, since_put=200.0, gap=PROGRESS_MAX) is None


def test_an_unchanged_status_is_refreshed_before_its_key_expires():
    put = running()
    assert status_due(put, running(updated=500.0), since_put=REFRESH - 1, gap=5.0) is None
    assert status_due(put, running(updated=500.0), since_put=REFRESH, gap=5.0) == "refresh"
    assert REFRESH < STATUS_TTL  # a key lives at least STATUS_TTL past its put (agent/leases.py)


def test_the_backoff_doubles_to_its_cap_and_restarts_at_a_change():
    gaps, gap = [], PROGRESS_FIRST
    for _ in range(8):
        gap = next_gap(gap, "progress")
        gaps.append(gap)
    assert gaps == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0, 300.0]
    assert next_gap(PROGRESS_MAX, "change") == PROGRESS_FIRST
    assert next_gap(40.0, "refresh") == 40.0


class FakeLeases:
    def __init__(self) -> None:
        self.puts: list[tuple[str, str, float]] = []
        self.times: list[float] = []  # the test clock at each put
        self.clock = lambda: 0.0
        self.fail = False

    def put(self, key: str, value: str, ttl: float, new: bool = False) -> None:
        if self.fail:
            raise StoreUnavailable("etcd is down")
        self.puts.append((key, value, ttl))
        self.times.append(self.clock())


class FakeMirror:
    def __init__(self) -> None:
        self.statuses: list[dict] = []

    def set_status(self, value: dict) -> None:
        self.statuses.append(value)


def publisher() -> tuple[StatusPublisher, FakeLeases, FakeMirror, Progress, list[float]]:
    leases, mirror, now = FakeLeases(), FakeMirror(), [0.0]
    leases.clock = lambda: now[0]
    progress = Progress(1, None)  # type: ignore[arg-type]  # steps only: nothing is forwarded
    pub = StatusPublisher(leases, JobKeys("j"), "a", "127.0.0.1", RequestStats(), progress,  # type: ignore[arg-type]
                          OutageReporter("status", Recorder()), mirror=mirror, clock=lambda: now[0])
    pub.round = RoundInfo(round=1, rank=0, world_size=2, master_addr="127.0.0.1", master_port=1,
                          ranks={"a": 0, "b": 1}, restarts=0, cause="test", started=0.0)
    return pub, leases, mirror, progress, now


def test_a_steady_round_puts_its_status_a_handful_of_times_then_every_five_minutes():
    """The round loop offers the status every 5 s for an hour while a step moves every pass: after the
    state change, puts come 5, 10, 20, ... s apart, then one per PROGRESS_MAX; the mirror sees all."""
    pub, leases, mirror, progress, now = publisher()
    pub.set_state("running")
    step = 0
    for t in range(5, 3600, 5):
        now[0] = float(t)
        step += 1
        progress.on_worker_event({"event": "train.step", "step": step, "local_rank": 0, "ts": t})
        pub.stats.reads += 1
        pub.publish()
    times = [0.0, *(t for t in range(5, 3600, 5))]
    assert len(mirror.statuses) == len(times)
    assert len(leases.puts) == 1 + 6 + (3600 - 315) // 300  # the change, 5..160 s apart, then 300 s
    assert all(ttl == STATUS_TTL for _, _, ttl in leases.puts)
    gaps = [b - a for a, b in zip(leases.times, leases.times[1:], strict=False)]
    assert gaps[:6] == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0] and set(gaps[6:]) == {300.0}


def test_a_state_change_is_put_even_within_the_backoff_and_a_failed_put_is_retried():
    pub, leases, _, _, now = publisher()
    pub.set_state("running")
    now[0] = 1.0
    pub.set_state("stopping")
    assert [NodeStatus.from_json(v).state for _, v, _ in leases.puts] == ["running", "stopping"]
    leases.fail = True
    now[0] = 2.0
    pub.set_state("joining")
    assert pub.outage.failures == 1 and len(leases.puts) == 2
    leases.fail = False
    now[0] = 2.5
    assert pub.publish() is True  # what was stored is still "stopping": the change is due again
    assert NodeStatus.from_json(leases.puts[-1][1]).state == "joining"


def test_status_shows_the_age_of_an_old_step_only():
    assert aged(1200, 1000.0, 1010.0) == 1200
    assert aged(1200, 1000.0, 1045.0) == "1200 (45s ago)"
    assert aged(1200, 1000.0, 1250.0) == "1200 (4m ago)"
    assert aged(None, 1000.0, 5000.0) is None
    assert aged(7, None, 5000.0) == 7 and aged(7, 0.0, 5000.0) == 7
