"""The store-outage rules as tables: what the judges, the closer and the fence decide while etcd fails,
stalls or was wiped (petctl/agent/roundjudge.py, decisions.py, health.py), and the two
agent parts that act on them (the heartbeat's re-assertion, the store rebuild), with fakes for etcd.
The same rules run against a real etcd in tests/e2e/test_store_faults.py."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from petctl.agent.agent import StoreRebuilder
from petctl.agent.decisions import EndJob, Freeze, RendezvousState, RoundInfo, Wait, decide, opening_round
from petctl.agent.health import FenceLook, OutageReporter, StoreHealth, should_fence, stall_limit
from petctl.agent.liveness import Heartbeat
from petctl.agent.roundjudge import Continue, Over, Rebuild, RoundOutcome, judge
from petctl.core.keys import JobKeys
from petctl.core.records import JobResult, NodeRecord, Phase, Round
from petctl.core.store import BACKENDS
from tests.support.emitter import Recorder
from tests.support.round_cases import (
    T0,
    WALL,
    act,
    frozen_round,
    joined_state,
    joining,
    now,
    settings,
    snapshot,
)
from tests.support.store import FakeStore

RANKS = {"a": 0, "b": 1, "c": 2}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def unsettled(snap):
    return dataclasses.replace(snap, settled=False)


# --- the running round's judge ------------------------------------------------------------------------
def _subsets():
    for alive_k in itertools.product([True, False], repeat=3):
        for done_k in itertools.product([True, False], repeat=3):
            yield ({n for n, up in zip("abc", alive_k, strict=True) if up} | {"w"},
                   {n for n, d in zip("abc", done_k, strict=True) if d})


@pytest.mark.parametrize("alive,done", list(_subsets()))
def test_while_unsettled_nobody_is_lost_or_admitted(alive, done):
    """Every subset of members alive or done (and a waiting node): unsettled, only 'all done' acts."""
    snap = unsettled(snapshot(alive, frozen_round(4, RANKS), done={4: set(done)}))
    for me in "abc":
        verdict = judge(snap, RoundInfo.of(frozen_round(4, RANKS), me), settings(me=me, max_nodes=4))
        expected = EndJob("succeeded", "all workers exited 0", 4) if done >= set(RANKS) else Continue()
        assert verdict == expected, (me, alive, done)


@pytest.mark.parametrize("others_alive", [set(), {"b"}, {"b", "c"}])
def test_our_own_key_missing_means_the_store_expired_it_not_that_the_others_died(others_alive):
    snap = snapshot(others_alive, frozen_round(4, RANKS))
    assert judge(snap, RoundInfo.of(frozen_round(4, RANKS), "a"), settings(me="a")) == Continue()


def test_a_settled_snapshot_with_our_key_still_judges_losses():
    snap = snapshot({"a"}, frozen_round(4, RANKS))
    verdict = judge(snap, RoundInfo.of(frozen_round(4, RANKS), "a"), settings(me="a"))
    assert verdict.event == "membership.lost" and verdict.nodes == ("b", "c")


def test_no_round_while_we_run_one_means_the_store_was_wiped():
    rnd = frozen_round(4, RANKS, restarts=2, prev_ranks={"a": 0, "b": 1})
    for alive in (set(), set(RANKS)):
        for snap in (snapshot(alive, None), unsettled(snapshot(alive, None))):
            assert judge(snap, RoundInfo.of(rnd, "b"), settings(me="b")) == Rebuild(rnd)


def test_a_round_info_without_its_record_cannot_rebuild():
    info = RoundInfo(round=4, rank=0, world_size=3, master_addr="m", master_port=1, ranks=RANKS, restarts=0,
                     cause="", started=WALL)
    assert judge(snapshot(set(RANKS), None), info, settings(me="a")) == Over(RoundOutcome.NEXT_ROUND)


# --- the rendezvous ---------------------------------------------------------------------------------
def test_the_closer_does_not_freeze_while_unsettled():
    st = joined_state(2, [("me", 0), ("b", 1)], min_waited=5.0)
    snap = snapshot({"me", "b"}, joining(2, {"me": 0, "b": 1}))
    assert isinstance(act(snap, st, settings()), Freeze)
    action = act(unsettled(snap), st, settings())
    assert isinstance(action, Wait) and action.timeout >= 0.5


def test_a_joiner_whose_key_expired_waits_for_it_instead_of_rejoining():
    st = joined_state(2, [("me", 0), ("b", 1)], min_waited=5.0)
    action = act(snapshot({"b"}, joining(2, {"me": 0, "b": 1})), st, settings())
    assert isinstance(action, Wait)


def test_below_min_never_fails_the_job_while_unsettled():
    st = RendezvousState(started=T0, below_min_since=T0 - 1000.0)
    snap = snapshot(set(), joining(3))
    s = settings(min_nodes=2, join_timeout=60.0)
    assert isinstance(act(snap, st, s), EndJob)
    assert not isinstance(act(unsettled(snap), st, s), EndJob)


def test_opening_round_after_a_wipe_carries_on_from_the_last_round_seen():
    assert opening_round(None, WALL) == Round(round=1, phase=Phase.JOINING, ts=WALL, cause="job start")
    after_frozen = opening_round(frozen_round(7, RANKS, restarts=2), WALL)
    assert (after_frozen.round, after_frozen.restarts, after_frozen.prev_ranks) == (8, 2, RANKS)
    assert after_frozen.phase is Phase.JOINING and after_frozen.cause.startswith("store rebuilt")
    after_joining = opening_round(joining(5, {"a": 0}), WALL)
    assert (after_joining.round, after_joining.prev_ranks) == (6, {"a": 0})


def test_decide_opens_the_first_round_when_etcd_holds_none():
    assert type(decide(snapshot({"me"}, None), RendezvousState(started=T0), settings(), now())[0]).__name__ \
        == "OpenFirstRound"


# --- the fence ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("unreachable,stalled,gap,running,fenced", [
    (None, 100.0, 0.1, True, False),  # etcd answers: never fence
    (10.0, None, 0.0, True, False),  # no step reported this round: a stall cannot be told from quiet
    (10.0, 100.0, 0.1, False, False),  # workers already exited
    (2.0, 100.0, 0.1, True, False),  # unreachable for less than a TTL: the others cannot have dropped us
    (10.0, 5.0, 0.1, True, False),  # steps still came recently: a store outage, the job is healthy
    (10.0, 6.5, 0.1, True, True),  # both: cut off
    (10.0, 30.0, 10.0, True, False),  # slow steps (10 s each): 30 s is not yet a stall
    (60.0, 41.0, 10.0, True, True),
])
def test_fence_only_when_cut_off_and_stalled(unreachable, stalled, gap, running, fenced):
    look = FenceLook(unreachable_for=unreachable, stalled_for=stalled, longest_gap=gap,
                     workers_running=running)
    assert should_fence(look, ttl=3.0) is fenced
    assert stall_limit(3.0, gap) == max(6.0, 4 * gap)


# --- the store's health ---------------------------------------------------------------------------------
def test_an_outage_is_reported_once_and_membership_trusted_only_after_grace():
    rec, clock = Recorder(), Clock()
    health = StoreHealth(rec, grace=4.0, slow=2.0, straggle=1.5, clock=clock)
    assert health.settled() and health.unreachable_for() is None
    for service in ("heartbeat", "watch", "snapshot", "heartbeat"):
        clock.t += 0.5
        health.failed(ConnectionError("refused"), service)
    assert not health.settled() and health.unreachable_for() == pytest.approx(1.5)
    clock.t += 10.0
    health.succeeded(0.01, "snapshot")
    assert rec.names() == ["store.unreachable", "store.reachable"]
    assert rec.events[1][1]["failed_calls"] == 4 and rec.events[1][1]["seconds"] == pytest.approx(11.5)
    assert not health.settled() and health.unreachable_for() is None
    clock.t += 1.0
    health.failed(TimeoutError("sent before the recovery"), "heartbeat")  # a straggler: no new outage
    assert rec.names() == ["store.unreachable", "store.reachable"] and health.unreachable_for() is None
    clock.t += 3.9
    assert not health.settled()  # the straggler disturbed: grace runs from it
    clock.t += 0.2
    assert health.settled() and health.outages == 1
    clock.t += 5.0
    health.failed(ConnectionError("down again"))
    assert rec.names()[-1] == "store.unreachable" and health.outages == 2


def test_a_slow_answer_or_our_own_key_gone_disturbs_without_an_outage():
    rec, clock = Recorder(), Clock()
    health = StoreHealth(rec, grace=4.0, slow=2.0, clock=clock)
    health.succeeded(2.5, "snapshot")
    assert not health.settled() and rec.names() == ["store.slow"]
    clock.t += 4.0
    assert health.settled()
    health.own_key_missing()
    assert not health.settled()
    clock.t += 4.0
    assert health.settled() and health.outages == 0


def test_a_quiet_service_counts_its_own_failures_and_forwards_them():
    rec, clock = Recorder(), Clock()
    health = StoreHealth(rec, grace=1.0, slow=1.0, clock=clock)
    watch = OutageReporter("watch", rec, parent=health)
    watch.failed(OSError("x"))
    watch.failed(OSError("x"))
    watch.succeeded()
    assert watch.failures == 2 and rec.names() == ["store.unreachable", "store.reachable"]


# --- the heartbeat re-asserts a vanished key ------------------------------------------------------------
def test_the_heartbeat_writes_its_vanished_key_again_and_disturbs_the_store():
    from petctl.io.eventlog import EventLog

    client, rec = FakeStore(), Recorder()  # its `gone`: the next keep-alive finds the lease expired
    events = EventLog("agent", stream=None)
    events.add_sink(lambda record: rec(record["event"]))
    health = StoreHealth(rec, grace=60.0, slow=60.0)
    beat = Heartbeat(client, JobKeys("j"), NodeRecord(node_id="n1", host_addr="h", pid=1), interval=0.02,
                     ttl=3, outage=OutageReporter("heartbeat", rec, parent=health), store=health,
                     events=events)
    beat.start()
    assert health.settled()
    client.gone = True
    from tests.support.agent_harness import wait_for

    wait_for(lambda: beat.reasserted == 1, 5, what="re-assertion")
    beat.stop(delete=True)
    assert client.writes == 2 and not health.settled()
    assert [n for n in rec.names() if n.startswith("heartbeat")] == ["heartbeat.lost", "heartbeat.reasserted"]


# --- the rebuild ----------------------------------------------------------------------------------------
class FakeRendezvous:
    """The rendezvous and its `kv` (the Store calls the rebuild makes) in one: a wiped store."""

    def __init__(self) -> None:
        self.keys = JobKeys("j")
        self.kv = self
        self.written: dict[str, str] = {}
        self.created: list[Round] = []

    def create_round(self, rnd: Round) -> bool:
        self.created.append(rnd)
        return len(self.created) == 1

    def create(self, key, value, lease=None) -> bool:
        if key in self.written:
            return False
        self.written[key] = value
        return True

    def put(self, key, value, lease=None) -> int:
        self.written[key] = value
        return len(self.written)

    def get(self, key):
        return None  # wiped: the rebuild only writes what it holds


class FakeMirror:
    def __init__(self, result: JobResult | None) -> None:
        self.result = result

    def read_result(self) -> JobResult | None:
        return self.result


def test_a_wiped_store_gets_the_round_and_the_spec_back():
    rdzv, rec = FakeRendezvous(), Recorder()
    from petctl.io.eventlog import EventLog

    events = EventLog("agent", stream=None)
    events.add_sink(lambda record: rec(record["event"]))
    rnd = frozen_round(4, RANKS, restarts=1)
    rebuilder = StoreRebuilder(rdzv, FakeMirror(None), '{"name": "j"}', events)
    rebuilder.rebuild(rnd)
    rebuilder.rebuild(rnd)  # a second agent's rebuild: create-only writes change nothing
    assert rdzv.created == [rnd, rnd] and rdzv.written == {"/petctl/jobs/j/spec": '{"name": "j"}'}
    assert rec.names() == ["store.rebuilt"]


def test_a_wiped_store_of_an_ended_job_gets_its_result_back_not_its_round():
    rdzv = FakeRendezvous()
    from petctl.io.eventlog import EventLog

    result = JobResult(state="succeeded", reason="all workers exited 0", ts=WALL, round=4, job="j", node="a")
    rebuilder = StoreRebuilder(rdzv, FakeMirror(result), "{}", EventLog("agent", stream=None))
    rebuilder.rebuild(frozen_round(4, RANKS))
    assert rdzv.created == []
    assert JobResult.from_json(rdzv.written["/petctl/jobs/j/result"]) == result
    final = Round.from_json(rdzv.written["/petctl/jobs/j/live/round"])
    assert final.phase is Phase.FINAL and final.state == "succeeded"


# --- a result written by an agent that lost etcd before flipping the round --------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_result_without_a_final_round_gets_one_from_the_next_writer(etcd_server, backend):
    from contextlib import closing

    from petctl.io.jobresult import record_result
    from tests.support.store import store_for

    keys = JobKeys("half-ended")
    first = JobResult(state="succeeded", reason="all workers exited 0", ts=WALL, round=3, job="half-ended")
    with closing(store_for(etcd_server.endpoint, backend=backend)) as store:
        store.delete_dir(keys.base)
        store.put(keys.result, first.to_json())  # the first writer's second write never happened
        store.put(keys.round, frozen_round(3, RANKS, restarts=1).to_json())
        second = dataclasses.replace(first, state="failed", reason="a later verdict")
        assert record_result(store, second) is False  # the first result stands ...
        final = Round.from_json(store.get(keys.round).value)
        assert (final.phase, final.state, final.restarts) == (Phase.FINAL, "succeeded", 1)  # ... and ends it
        assert JobResult.from_json(store.get(keys.result).value) == first
