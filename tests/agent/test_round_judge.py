"""A running round's judges as tables: what `live/` and the workers mean for the round
(petctl/agent/roundjudge.py), with no etcd, no torch and no clock."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from petctl.agent.decisions import (
    EndJob,
    RoundInfo,
    next_round,
)
from petctl.agent.roundjudge import (
    AskRestart,
    Continue,
    HandOff,
    HandoffLook,
    Idle,
    MarkHandoff,
    MembershipChange,
    Over,
    ReportFailure,
    RoundOutcome,
    StopLingering,
    Succeeded,
    Timing,
    TrainOn,
    Workers,
    WorkerWatch,
    handoff,
    handoff_at,
    judge,
    judge_workers,
    preempted_why,
    save_estimate,
)
from petctl.core.records import Phase, Round, SaveNow
from tests.support.round_cases import (
    T0,
    WALL,
    frozen_round,
    joining,
    settings,
    snapshot,
)


# --- a running round: what live/ says -----------------------------------------------------------------
def info_of(ranks: dict[str, int], me: str, round_no: int = 4) -> RoundInfo:
    return RoundInfo(round=round_no, rank=ranks[me], world_size=len(ranks), master_addr="m", master_port=1,
                     ranks=ranks, restarts=0, cause="", started=WALL)


RANKS = {"a": 0, "b": 1, "c": 2}


def _live_cases():
    """Every subset of members alive x every subset done, plus a waiting node or not, for each member."""
    cases = []
    for alive_k in itertools.product([True, False], repeat=3):
        for done_k in itertools.product([True, False], repeat=3):
            for waiting in (False, True):
                alive = {n for n, up in zip("abc", alive_k, strict=True) if up}
                alive |= {"w"} if waiting else set()
                done = {n for n, d in zip("abc", done_k, strict=True) if d}
                cases.append((frozenset(alive), frozenset(done)))
    return cases


@pytest.mark.parametrize("alive,done", _live_cases())
@pytest.mark.parametrize("max_nodes", [3, 4])
@pytest.mark.parametrize("finishing", [False, True])
def test_lost_versus_done_versus_waiting(alive, done, max_nodes, finishing):
    """Once a member is done (or our own workers are finishing), the job's workers have finished: no
    membership change re-forms the round (issue 25: a scale-up near the end restarted a finished job)."""
    snap = snapshot(alive, frozen_round(4, RANKS), done={4: set(done)})
    for me in sorted(set(RANKS) & alive):
        verdict = judge(snap, info_of(RANKS, me), settings(me=me, max_nodes=max_nodes), finishing=finishing)
        lost = sorted(n for n in RANKS if n not in alive and n not in done)
        lowest = min(RANKS[n] for n in RANKS if n in alive) == RANKS[me]
        if done >= set(RANKS):
            assert verdict == EndJob("succeeded", "all workers exited 0", 4)
        elif done and set(lost) | done >= set(RANKS):
            assert verdict == EndJob("succeeded", f"all workers exited 0 ({','.join(lost)} lost after the "
                                     "others finished)", 4)
        elif done or finishing:
            assert verdict == Continue(), (alive, done, me)
        elif lost:
            assert verdict == MembershipChange("membership.lost", tuple(lost), f"node lost: {','.join(lost)}")
        elif "w" in alive and max_nodes > 3 and lowest:
            assert verdict == MembershipChange("membership.waiting", ("w",), "scale-up: w")
        elif done >= set(RANKS):
            assert verdict == EndJob("succeeded", "all workers exited 0", 4)
        else:
            assert verdict == Continue()


@pytest.mark.parametrize("rnd,outcome", [
    (Round(round=None, phase=Phase.FINAL, ts=WALL, state="killed"), RoundOutcome.JOB_ENDED),
    (Round(round=4, phase=Phase.FINAL, ts=WALL, state="failed"), RoundOutcome.JOB_ENDED),
    (joining(5), RoundOutcome.NEXT_ROUND),
    (frozen_round(5, RANKS), RoundOutcome.NEXT_ROUND),
    (None, RoundOutcome.NEXT_ROUND),
])
def test_a_replaced_or_final_round_is_over(rnd, outcome):
    assert judge(snapshot(set(RANKS), rnd), info_of(RANKS, "a"), settings(me="a")) == Over(outcome)


def test_a_preempted_round_goes_on_until_the_noticed_node_leaves():
    rnd = frozen_round(4, RANKS, save_now=SaveNow(node_id="c", deadline=WALL + 100))
    assert judge(snapshot(set(RANKS), rnd), info_of(RANKS, "a"), settings(me="a")) == Continue()


# --- a running round: what the workers say -------------------------------------------------------------
TIMING = Timing(finish_grace=60.0, fail_grace=3.0)


def workers(**kw) -> Workers:
    base = dict(exited=False, succeeded=False, first_failure=None, some_succeeded=False, running=True,
                round_done_elsewhere=False, saving_now=False)
    base.update(kw)
    return Workers(**base)


EXITED_OK = dict(exited=True, succeeded=True, some_succeeded=True, running=False)
FAILED = dict(exited=True, first_failure=(1, 7), running=False)


@pytest.mark.parametrize("look,watch,t,step", [
    (workers(), WorkerWatch(), 0.0, Idle()),
    (workers(**EXITED_OK), WorkerWatch(), 0.0, Succeeded()),
    (workers(**FAILED), WorkerWatch(), 0.0, ReportFailure(1, 7)),
    (workers(**FAILED), WorkerWatch(failure="f", failed_at=T0), 2.9, Idle()),
    (workers(**FAILED), WorkerWatch(failure="f", failed_at=T0), 3.1, AskRestart("f")),
    (workers(**FAILED), WorkerWatch(failure="f", failed_at=T0, restart_asked=True), 99.0, Idle()),
    (workers(some_succeeded=True), WorkerWatch(), 0.0, Idle()),
    (workers(some_succeeded=True), WorkerWatch(finishing_since=T0), 59.0, Idle()),
    (workers(some_succeeded=True), WorkerWatch(finishing_since=T0), 61.0, StopLingering(60.0)),
    (workers(round_done_elsewhere=True), WorkerWatch(finishing_since=T0), 61.0, StopLingering(60.0)),
    # Every running worker's script finished (worker.exiting): only their exit is left, and it gets
    # exit_grace, not finish_grace (a gloo group's destructor can deadlock it).
    (workers(exiting_since=T0), WorkerWatch(), 9.9, Idle()),
    (workers(exiting_since=T0), WorkerWatch(), 10.1,
     StopLingering(10.0, "stuck at exit after the script finished")),
    (workers(some_succeeded=True, exiting_since=T0), WorkerWatch(finishing_since=T0), 10.1,
     StopLingering(10.0, "stuck at exit after the script finished")),
    (workers(exiting_since=T0, saving_now=True), WorkerWatch(), 99.0, Idle()),  # a leave is not an exit
    (workers(**EXITED_OK), WorkerWatch(finished=True), 0.0, Idle()),
    (workers(**FAILED, saving_now=True), WorkerWatch(), 0.0, Idle()),
    (workers(**EXITED_OK, saving_now=True), WorkerWatch(), 0.0, Idle()),
    (workers(some_succeeded=True, saving_now=True), WorkerWatch(finishing_since=T0), 99.0, Idle()),
])
def test_worker_steps(look, watch, t, step):
    got, _ = judge_workers(watch, look, T0 + t, TIMING, "n1")
    assert got == step


def test_a_failure_is_described_once_and_restarted_once():
    watch = WorkerWatch()
    steps = []
    for t in (0.0, 1.0, 3.5, 4.0, 10.0):
        step, watch = judge_workers(watch, workers(**FAILED), T0 + t, TIMING, "n1")
        steps.append(step)
    cause = "worker failure on n1 (local rank 1, exit code 7)"
    assert steps == [ReportFailure(1, 7), Idle(), AskRestart(cause), Idle(), Idle()]


def test_the_first_success_anywhere_starts_the_finish_grace():
    _, watch = judge_workers(WorkerWatch(), workers(round_done_elsewhere=True), T0, TIMING, "n1")
    assert watch.finishing_since == T0
    _, watch = judge_workers(watch, workers(some_succeeded=True), T0 + 5, TIMING, "n1")
    assert watch.finishing_since == T0


# --- a preempted round's end, in words ------------------------------------------------------------------
DONE = RoundOutcome.PREEMPTED.value  # "preemption checkpoint done": only when every local worker saved
SIGTERMED = "preempted: workers stopped by SIGTERM, no save reported"


@pytest.mark.parametrize("protocol,saved,nproc,timed_out,why", [
    (True, 2, 2, False, DONE),
    (True, 2, 2, True, DONE),  # saved just as the deadline passed: it is there
    (True, 1, 1, False, DONE),
    (False, 0, 1, False, SIGTERMED),  # a plain script: SIGTERM at the notice, nothing reported saved
    (False, 0, 2, True, SIGTERMED),
    (False, 0, 2, False, SIGTERMED),
    (True, 0, 2, True, "preempted: save timed out, 0 of 2 local workers saved"),
    (True, 1, 2, True, "preempted: save timed out, 1 of 2 local workers saved"),
    (True, 1, 2, False, "preempted: workers exited before saving, 1 of 2 local workers saved"),
    (True, 0, 1, False, "preempted: workers exited before saving, 0 of 1 local workers saved"),
])
def test_a_preempted_round_says_whether_anything_was_saved(protocol, saved, nproc, timed_out, why):
    assert preempted_why(protocol=protocol, saved=saved, nproc=nproc, timed_out=timed_out) == why


def test_the_agent_reads_the_words_from_the_control_files(tmp_path):
    """The agent's side of it: the control dir's markers, as the workers left them."""
    from petctl.agent.notices import PreemptionHandler
    from petctl.io import controlfiles

    handler = PreemptionHandler(config=None, events=None)  # type: ignore[arg-type]
    assert handler.why_stopped(tmp_path, 2) == SIGTERMED  # a plain script: no marker, no save
    controlfiles.mark_elastic(tmp_path, 0)
    controlfiles.mark_elastic(tmp_path, 1)
    controlfiles.write_saved(tmp_path, 0, 41)
    assert handler.why_stopped(tmp_path, 2) == (
        "preempted: workers exited before saving, 1 of 2 local workers saved")
    controlfiles.write_saved(tmp_path, 1, 41)
    assert handler.why_stopped(tmp_path, 2) == DONE


# --- a mixed ending names its failure in the job's reason -----------------------------------------------
def test_a_mixed_ending_is_succeeded_and_its_reason_names_the_failure():
    """A node whose workers failed after a rank had exited 0 is done (nothing restarts, docs/reliability.md),
    but the job's reason must not read as a clean finish: it names the node and the failure."""
    rnd = frozen_round(4, RANKS)
    clean = snapshot({"a", "b", "c"}, rnd, done={4: {"a", "b", "c"}})
    assert judge(clean, info_of(RANKS, "a"), settings("a")) == EndJob("succeeded", "all workers exited 0", 4)
    mixed = dataclasses.replace(clean, mixed={4: {"c": "local rank 0 exited with code 1"}})
    verdict = judge(mixed, info_of(RANKS, "a"), settings("a"))
    assert isinstance(verdict, EndJob) and verdict.state == "succeeded"
    assert "all workers exited 0" not in verdict.reason
    assert "c: local rank 0 exited with code 1" in verdict.reason and "failed after" in verdict.reason
    # A mixed failure in another round says nothing of this one.
    other = dataclasses.replace(clean, mixed={3: {"c": "exit 1"}})
    assert judge(other, info_of(RANKS, "a"), settings("a")).reason == "all workers exited 0"
    # A member lost after the others finished is still named beside the failure.
    lost = dataclasses.replace(mixed, alive=frozenset({"a", "c"}), done={4: frozenset({"a", "c"})})
    verdict = judge(lost, info_of(RANKS, "a"), settings("a"))
    assert verdict.reason.endswith("(b lost after the others finished)")


def test_the_done_record_carries_a_mixed_failure_through_etcd(etcd_server):
    """The failure a node stores with its `done` mark is what every other node's reader sees (real etcd)."""
    from petctl.agent.rendezvous import LiveReader, RequestStats
    from petctl.core.keys import JobKeys
    from petctl.core.records import DoneRecord
    from petctl.io.eventlog import EventLog
    from tests.support.store import store_for

    keys, client = JobKeys("mixed-done"), store_for(etcd_server.endpoint)
    client.put(f"{keys.done(4)}/a", DoneRecord(ts=WALL).to_json())
    failed = DoneRecord(ts=WALL, failure="local rank 0 exited with code 1")
    client.put(f"{keys.done(4)}/c", failed.to_json())
    client.put(f"{keys.done(4)}/d", "not json")  # corrupt: still done (its presence), counted, no failure
    snap = LiveReader(client, keys, RequestStats(), EventLog("test")).view()
    client.close()
    assert snap.done_in(4) == {"a", "c", "d"}
    assert snap.mixed == {4: {"c": "local rank 0 exited with code 1"}}


# --- a spot notice's hand-off -------------------------------------------------------------------------------
@pytest.mark.parametrize("handing_off,alive,me,admits", [
    ({}, {"a", "b", "c", "w"}, "a", True),  # nobody handing off: the lowest rank admits
    ({"c": WALL + 120}, {"a", "b", "c", "w"}, "a", False),  # c hands its place to w: not a's to admit
    ({"c": WALL + 120}, {"a", "b", "w"}, "a", False),  # c is gone: lost first, judged as such
    ({"x": WALL + 120}, {"a", "b", "c", "w"}, "a", True),  # a stale entry of a node not in the round
])
def test_a_waiting_node_is_the_noticed_members_to_admit(handing_off, alive, me, admits):
    """While a member under a spot notice is alive and trains on, the waiting node (its replacement) joins
    in that member's hand-off, in one re-form: nobody else admits it first (a re-form at N+1 then N)."""
    rnd = frozen_round(4, RANKS, handoffs=handing_off)
    verdict = judge(snapshot(alive, rnd), info_of(RANKS, me), settings(me=me, max_nodes=4))
    if admits:
        assert verdict == MembershipChange("membership.waiting", ("w",), "scale-up: w")
    elif "c" not in alive:
        assert verdict == MembershipChange("membership.lost", ("c",), "node lost: c")
    else:
        assert verdict == Continue()


def test_handoffs_are_a_round_field_that_the_next_round_drops():
    rnd = frozen_round(4, RANKS, handoffs={"c": WALL + 120})
    assert Round.from_json(rnd.to_json()) == rnd
    nxt = next_round(rnd, "preemption of c", False, 3, WALL + 1, leaving="c")
    assert nxt.handoffs == {} and "c" not in nxt.prev_ranks


def look(**kw) -> HandoffLook:
    base = dict(kind="spot", now=WALL, handoff_at=WALL + 60, waiting=False, marked=False)
    base.update(kw)
    return HandoffLook(**base)


@pytest.mark.parametrize("kw,step", [
    ({}, MarkHandoff()),  # a fresh spot notice: say so on the round, and train on
    ({"marked": True}, TrainOn()),
    ({"marked": True, "waiting": True}, HandOff("replacement")),  # the replacement is up: one re-form
    ({"waiting": True}, HandOff("replacement")),
    ({"marked": True, "now": WALL + 60}, HandOff("deadline")),  # the last moment that leaves the save
    ({"now": WALL + 61, "handoff_at": WALL + 60}, HandOff("deadline")),  # a late-seen notice saves at once
    ({"kind": "asg"}, HandOff("notice")),  # a scale-in: nothing replaces it
    ({"kind": "leave"}, HandOff("notice")),
])
def test_the_noticed_node_trains_until_its_replacement_or_its_last_safe_step(kw, step):
    assert handoff(look(**kw)) == step


@pytest.mark.parametrize("measured,budget,estimate", [
    ([], 22.5, 22.5),  # nothing measured yet: the whole budget, so the node hands off at once
    ([0.4, 2.0, 1.0], 90.0, 2.0 * 2.0 + 1.0),  # the longest recent save, twice (one may be in flight), +1 s
])
def test_the_save_estimate_is_learned_from_measured_saves(measured, budget, estimate):
    assert save_estimate(measured, budget) == pytest.approx(estimate)


def test_a_node_that_never_measured_a_save_hands_off_at_once():
    noticed, save_deadline = WALL, WALL + 22.5
    at = handoff_at(save_deadline, save_estimate([], save_deadline - noticed), step_s=0.2)
    assert handoff(look(handoff_at=at, now=noticed + 0.5)) == HandOff("deadline")


def test_handoff_at_leaves_the_step_under_way_and_the_save():
    assert handoff_at(save_deadline=100.0, save_s=4.0, step_s=0.5) == pytest.approx(95.5)


def test_rank_0_publishes_its_save_time_through_the_interval_that_follows():
    """A noticed node of another rank plans its hand-off with rank 0's published save time. With
    every="auto" a `checkpoint.interval` line follows each save: it must not drop the save's time (it did,
    and every noticed node then handed off at once, as if no save had been measured)."""
    import io

    from petctl.agent.reporting import Progress
    from petctl.io.eventlog import EventLog

    progress = Progress(nproc=1, events=EventLog("agent", stream=io.StringIO()))
    progress.on_worker_event({"event": "checkpoint.saved", "rank": 0, "step": 9, "url": "file:///c",
                              "seconds": 0.25})
    progress.on_worker_event({"event": "checkpoint.interval", "rank": 0, "interval_s": 30.0, "reason": "r"})
    assert progress.last_checkpoint.save_s == 0.25 and progress.last_checkpoint.interval_s == 30.0
    assert progress.last_checkpoint.step == 9 and list(progress.save_seconds) == [0.25]
