"""The soak's oracle (bench/soakoracle.py) and plan (bench/soakplan.py) on hand-made histories: each
invariant holds on a good one and is judged broken on one made to break it (a test that cannot fail
would be a defect of the soak)."""

from __future__ import annotations

import pytest

from bench import soakoracle as o
from bench import soakplan
from bench.soakoracle import Fault, JobEnd, Join, Leftovers, Resume, Step


def steps(spec: list[tuple[float, int, int]], world: int = 3, node: str = "a") -> list[Step]:
    """(ts, step, round) triples as rank 0's ledger, written by `node`."""
    return [Step(ts, step, rnd, world, node) for ts, step, rnd in spec]


def joins(rounds: dict[int, dict[str, int]], world: int = 3) -> list[Join]:
    return [Join(float(n), node, n, rank, world)
            for n, ranks in rounds.items() for node, rank in ranks.items()]


def kill(at: float, round_at: int = 1, index: int = 0, kind: str = "kill") -> Fault:
    return Fault(index=index, kind=kind, injected=at, cleared=at, round_at=round_at, target="b")


# --- the plan ---------------------------------------------------------------------------------------------
def test_the_same_seed_replays_the_same_history_and_another_seed_does_not():
    assert soakplan.plan(50, 3) == soakplan.plan(50, 3)
    assert soakplan.plan(50, 3) != soakplan.plan(50, 4)


def test_overlapping_faults_land_within_five_seconds_and_rates_leave_kinds_out():
    plan = soakplan.plan(300, 1, soakplan.parse_rates(["etcd_down=0", "kill=5"]), overlap=0.7)
    assert {p.kind for p in plan} <= set(soakplan.KINDS) - {"etcd_down"}
    close = [p.after for p in plan if p.after is not None]
    assert close and all(0.0 <= a <= soakplan.OVERLAP_WINDOW for a in close)
    assert plan[0].after is None  # the first fault waits for a job that trains
    with pytest.raises(ValueError):
        soakplan.parse_rates(["partition=1"])  # not a local kind: refused, not faked


# --- recovery and stalls ------------------------------------------------------------------------------
def test_a_kill_is_recovered_by_the_first_step_of_a_newer_round():
    history = steps([(1, 0, 1), (2, 1, 1), (3.5, 2, 1), (8, 2, 2), (9, 3, 2)])
    (out,), violations = o.recoveries([kill(3.0)], history, now=20)
    assert violations == [] and out.state == "recovered" and out.seconds == 5.0


def test_a_kill_whose_job_never_trains_again_is_a_hang_once_its_bound_passed():
    history = steps([(1, 0, 1), (2, 1, 1), (3.5, 2, 1)])  # round 1 went on printing: no re-form
    f = kill(3.0)
    (out,), _ = o.recoveries([f], history, now=3.0 + f.bound - 1)
    assert out.state == "pending"
    (out,), violations = o.recoveries([f], history, now=3.0 + f.bound + 1)
    assert out.state == "hung" and [v.invariant for v in violations] == ["recovery"]
    assert "not training again" in violations[0].message


def test_a_later_fault_that_lands_before_recovery_extends_the_bound():
    first, second = kill(0.0, index=0), kill(50.0, index=1)
    history = steps([(0.0, 0, 1), (100.0, 1, 2)])  # trained again 100 s after the first kill
    outcomes, violations = o.recoveries([first, second], history, now=200)
    assert violations == [] and [x.state for x in outcomes] == ["recovered", "recovered"]
    alone, violations = o.recoveries([first], history, now=200)
    assert [v.invariant for v in violations] == ["recovery"]
    late = kill(70.0, index=1)  # after the first one's deadline (60 s): it rescues nothing
    outcomes, violations = o.recoveries([first, late], history, now=200)
    assert [x.state for x in outcomes] == ["hung", "recovered"] and len(violations) == 1


def freeze(at: float, until: float, node: str, index: int = 0, round_at: int = 1) -> Fault:
    return Fault(index=index, kind="freeze", injected=at, cleared=until, round_at=round_at, target=node)


def test_a_freeze_of_every_member_at_once_is_recovered_in_the_same_round():
    """Nobody is left to drop anyone: thawed, the round trains on. Seed 7's 200 faults judged three such
    freezes hung (every member frozen, the job training on in its round) until a later change re-formed."""
    history = steps([(1, 0, 1), (2, 1, 1), (9, 2, 1), (10, 3, 1)], world=2)
    members = joins({1: {"a": 0, "b": 1}}, world=2)
    both = [freeze(3.0, 8.0, "a", 0), freeze(4.0, 8.5, "b", 1)]
    outcomes, violations = o.recoveries(both, history, now=200, joins=members)
    assert violations == [] and [x.seconds for x in outcomes] == [6.0, 5.0]
    one = [freeze(3.0, 8.0, "a", 0)]  # b trained on alone: a must be dropped, a newer round must come
    (out,), violations = o.recoveries(one, history, now=200, joins=members)
    assert out.state == "hung" and [v.invariant for v in violations] == ["recovery"]
    apart = [freeze(3.0, 5.0, "a", 0), freeze(6.0, 8.0, "b", 1)]  # never both at once
    _, violations = o.recoveries(apart, history, now=200, joins=members)
    assert len(violations) == 2
    _, violations = o.recoveries(both, history, now=200)  # members unknown: a re-form is required
    assert len(violations) == 2


def test_a_freeze_within_the_lease_may_be_ridden_out_and_a_longer_one_must_re_form():
    """Seed 11's 200 faults judged a 2 s freeze hung at a 2 s TTL: the round trained on in the same round,
    which is right when the lease has not expired. A freeze past TTL + slack must drop the node."""
    history = steps([(1, 0, 1), (2, 1, 1), (6, 2, 1), (7, 3, 1)], world=2)
    members = joins({1: {"a": 0, "b": 1}}, world=2)
    short = freeze(3.0, 5.0, "b")
    (out,), violations = o.recoveries([short], history, now=200, joins=members, lease=2.0)
    assert violations == [] and out.seconds == 3.0
    (out,), violations = o.recoveries([short], history, now=200, joins=members)  # lease unknown: re-form
    assert out.state == "hung" and violations
    long = freeze(3.0, 3.0 + 2.0 + o.LEASE_SLACK + 0.5, "b")
    history = steps([(1, 0, 1), (2, 1, 1), (9, 2, 1), (10, 3, 1)], world=2)
    (out,), violations = o.recoveries([long], history, now=200, joins=members, lease=2.0)
    assert out.state == "hung" and [v.invariant for v in violations] == ["recovery"]
    (out,), violations = o.recoveries([long], history + steps([(11, 4, 2)], world=1), now=200,
                                      joins=members, lease=2.0)
    assert violations == [] and out.seconds == 8.0


def test_a_scale_to_the_world_the_job_has_needs_no_re_form_and_one_to_another_does():
    history = steps([(1, 0, 1), (2, 1, 1), (9, 2, 1), (10, 3, 1)], world=2)
    same = Fault(index=0, kind="scale_down", injected=3.0, cleared=3.0, round_at=1, target="size 2", size=2)
    (out,), violations = o.recoveries([same], history, now=200)
    assert violations == [] and out.seconds == 6.0
    other = Fault(index=0, kind="scale_up", injected=3.0, cleared=3.0, round_at=1, target="size 3", size=3)
    (out,), violations = o.recoveries([other], history, now=200)
    assert out.state == "hung" and violations


def test_a_scale_superseded_before_it_was_reached_is_owed_nothing_and_the_later_one_is_judged():
    """Seed 11's 200 faults: a burst to 3 at world 2, then 7 s later a scale to 2; the job rightly stayed
    at 2, and the oracle judged the burst hung for want of a world of 3."""
    history = steps([(1, 0, 1), (2, 1, 1), (9, 2, 1), (10, 3, 1), (70, 4, 1)], world=2)
    burst = Fault(index=0, kind="burst", injected=3.0, cleared=3.0, round_at=1, target="sizes 3,2,3", size=3)
    back = Fault(index=1, kind="scale_down", injected=8.0, cleared=8.0, round_at=1, target="size 2", size=2)
    outcomes, violations = o.recoveries([burst, back], history, now=200)
    assert violations == [] and [x.seconds for x in outcomes] == [6.0, 1.0]
    (out,), violations = o.recoveries([burst], history, now=200)  # alone, it is owed a world of 3
    assert out.state == "hung" and violations
    onward = Fault(index=1, kind="scale_up", injected=8.0, cleared=8.0, round_at=1, target="size 4", size=4)
    _, violations = o.recoveries([burst, onward], history, now=200)  # the later one is owed its size
    assert [v.context["fault"]["index"] for v in violations] == [1]


def test_a_job_that_ended_for_a_stated_reason_is_not_a_hang():
    f = kill(3.0)
    (out,), violations = o.recoveries([f], steps([(1, 0, 1)]), now=500, end=JobEnd(10.0, "failed", "x"))
    assert violations == [] and out.state == "ended"
    (out,), violations = o.recoveries([f], steps([(1, 0, 1)]), now=500, end=JobEnd(10.0, "failed", ""))
    assert out.state == "hung" and violations  # ended without a reason: not good enough


def test_a_gap_without_a_fault_is_a_stall_and_one_within_a_fault_is_not():
    history = steps([(0, 0, 1), (1, 1, 1), (100, 2, 1), (101, 3, 1)])
    assert [v.invariant for v in o.stalls(history, [], [], now=102)] == ["stall"]
    f = kill(0.5)  # its window ends at its deadline (60.5 s): the 40 s after it are a stall
    outcomes, _ = o.recoveries([f], history, now=102)
    (v,) = o.stalls(history, [f], outcomes, now=102)
    assert (v.context["from"], v.context["to"]) == (f.injected + f.bound, 100)
    long = Fault(0, "etcd_stall", 0.5, 60.0, 1)
    outcomes, _ = o.recoveries([long], history, now=102)
    assert o.stalls(history, [long], outcomes, now=102) == []
    assert [v.invariant for v in o.stalls(history[:2], [], [], now=200)] == ["stall"]  # the tail too


# --- agreement ---------------------------------------------------------------------------------------------
def test_one_node_per_rank_and_one_world_per_round_hold():
    good = joins({1: {"a": 0, "b": 1, "c": 2}, 2: {"a": 0, "c": 1}})
    assert o.agreement(good, steps([(1, 0, 1), (2, 1, 2)])) == []


@pytest.mark.parametrize("bad, needle", [
    ([Join(1, "a", 1, 0, 3), Join(1, "b", 1, 0, 3)], "a rank held by two nodes"),
    ([Join(1, "a", 1, 0, 3), Join(1, "a", 1, 1, 3)], "a node told two ranks"),
    ([Join(1, "a", 1, 0, 3), Join(1, "b", 1, 1, 2)], "disagree on the world size"),
    ([Join(1, "a", 1, 0, 2), Join(1, "b", 1, 2, 2)], "a rank outside its world"),
])
def test_a_split_round_is_judged_broken(bad, needle):
    violations = o.agreement(bad, [])
    assert any(needle in v.message for v in violations), violations


def test_steps_written_by_a_node_that_was_not_rank_0_break_agreement():
    violations = o.agreement(joins({1: {"a": 0, "b": 1}}), steps([(1, 0, 1)], node="b"))
    assert [v.invariant for v in violations] == ["agreement"]


# --- steps redone -----------------------------------------------------------------------------------------
def redo_of(history, resumes, faults, rounds, cadences=()):
    outcomes, _ = o.recoveries(faults, history, now=1e9)
    found = o.redos(history, resumes, faults, outcomes, joins(rounds), durable_every=10, cadences=cadences)
    return found, o.redo_violations(found, history)


def test_an_unannounced_loss_may_redo_one_step_and_not_two():
    rounds = {1: {"a": 0, "b": 1, "c": 2}, 2: {"a": 0, "b": 1}}
    history = steps([(1, 0, 1), (2, 1, 1), (3, 2, 1), (6, 2, 2), (7, 3, 2)])
    found, violations = redo_of(history, [Resume(0.5, 0, 1, 3, "a"), Resume(5, 2, 2, 2, "a")],
                                [kill(3.2)], rounds)
    assert [(r.redone, r.allowed) for r in found] == [(1, 1)] and violations == []
    history = steps([(1, 0, 1), (2, 1, 1), (3, 2, 1), (6, 1, 2), (7, 2, 2)])
    found, violations = redo_of(history, [Resume(0.5, 0, 1, 3, "a"), Resume(5, 1, 2, 2, "a")],
                                [kill(3.2)], rounds)
    assert [(r.redone, r.allowed) for r in found] == [(2, 1)]
    assert [v.invariant for v in violations] == ["redone"]


def test_an_unannounced_loss_may_redo_one_snapshot_interval_as_the_job_set_it():
    """Under load the cadence may take snapshots every K steps (`snapshot.every`, docs/elastic.md); a
    loss then costs up to K. K counts from the round that trained, as set before the resume, and only
    from that round's nodes."""
    rounds = {1: {"a": 0, "b": 1, "c": 2}, 2: {"a": 0, "b": 1}}
    history = steps([(1, 0, 1), (2, 1, 1), (3, 2, 1), (6, 1, 2), (7, 2, 2)])
    resumes = [Resume(0.5, 0, 1, 3, "a"), Resume(5, 1, 2, 2, "a")]
    k2 = [o.Cadence(0.6, "b", 1), o.Cadence(1.5, "b", 2)]
    found, violations = redo_of(history, resumes, [kill(3.2)], rounds, k2)
    assert [(r.redone, r.allowed) for r in found] == [(2, 2)] and violations == []
    assert "snapshots every 2 steps" in found[0].why
    for cadences in ([o.Cadence(1.5, "b", 2), o.Cadence(2.5, "b", 1)],  # lowered again before the loss
                     [o.Cadence(5.5, "b", 2)],  # set after the resume
                     [o.Cadence(1.5, "z", 2)]):  # by a node not in the round
        found, violations = redo_of(history, resumes, [kill(3.2)], rounds, cadences)
        assert [(r.redone, r.allowed) for r in found] == [(2, 1)], cadences
        assert [v.invariant for v in violations] == ["redone"]
    history = steps([(1, 0, 1), (2, 1, 1), (3, 2, 1), (6, 0, 2), (7, 1, 2)])
    found, violations = redo_of(history, [Resume(0.5, 0, 1, 3, "a"), Resume(5, 0, 2, 2, "a")],
                                [kill(3.2)], rounds, k2)
    assert [(r.redone, r.allowed) for r in found] == [(3, 2)]  # three: more than one interval
    assert [v.invariant for v in violations] == ["redone"]
    scale = Fault(0, "scale_up", 2.5, 2.5, 1)
    found, _ = redo_of(history, [Resume(0.5, 0, 1, 3, "a"), Resume(5, 2, 2, 2, "a")], [scale], rounds, k2)
    assert found[0].allowed == 0  # a planned change saves first, whatever K


def test_a_planned_change_may_redo_nothing():
    rounds = {1: {"a": 0, "b": 1}, 2: {"a": 0, "b": 1, "c": 2}}
    history = steps([(1, 0, 1), (2, 1, 1), (3, 2, 1), (6, 2, 2)])
    scale = Fault(0, "scale_up", 2.5, 2.5, 1)
    found, violations = redo_of(history, [Resume(5, 2, 2, 3, "a")], [scale], rounds)
    assert [(r.redone, r.allowed) for r in found] == [(1, 0)] and len(violations) == 1


def test_a_redo_nobody_caused_is_a_violation_and_all_lost_allows_the_durable_interval():
    rounds = {1: {"a": 0, "b": 1}, 2: {"c": 0, "d": 1}}
    history = steps([(1, 0, 1), (2, 1, 1), (3, 2, 1), (3.5, 3, 1), (6, 0, 2, )])
    found, violations = redo_of(history, [Resume(5, 0, 2, 2, "c")], [], rounds)
    assert found[0].allowed == 0 and violations
    both = [kill(3.6, index=0), kill(3.7, index=1)]
    found, violations = redo_of(history, [Resume(5, 0, 2, 2, "c")], both, rounds)
    assert (found[0].redone, found[0].allowed) == (4, 10) and violations == []


def test_a_resume_past_every_step_run_is_a_skipped_step():
    history = steps([(1, 0, 1), (2, 1, 1), (6, 3, 2)])
    assert [v.invariant for v in o.redo_violations([], history)] == ["redone"]


def test_one_line_lost_with_a_killed_rank_0_is_not_a_skip_but_two_are():
    """Rank 0 killed after step 2's collective, before its line: the survivor resumes at 3 (seen in the
    v2 soak, seed 11). Next to a kill that is one lost line; two missing steps, or none nearby, a skip."""
    history = steps([(1, 0, 1), (2, 1, 1), (6, 3, 2)])
    near_kill = [o.Redo(2, 5.0, 3, 0, 1, "kill#0")]
    assert o.redo_violations(near_kill, history) == []
    planned = [o.Redo(2, 5.0, 3, 0, 0, "scale_up#0")]
    assert [v.invariant for v in o.redo_violations(planned, history)] == ["redone"]
    two = steps([(1, 0, 1), (6, 3, 2)])
    assert [v.invariant for v in o.redo_violations(near_kill, two)] == ["redone"]


# --- the end -------------------------------------------------------------------------------------------
def test_final_weights_within_tolerance_and_a_lost_update_is_caught():
    assert o.weights([1.0, 2.0], [1.0 + 1e-12, 2.0]) == []
    assert [v.invariant for v in o.weights([1.0, 2.0], [1.0, 2.001])] == ["weights"]
    assert o.weights([1.0], None) and o.weights([1.0], [1.0, 2.0]) and o.weights([1.0], [float("nan")])


def test_status_accounting_must_equal_the_ledger():
    assert o.accounting({"steps_kept": 40, "steps_lost": 2}, {"steps_kept": 40, "steps_lost": 2}) == []
    assert o.accounting({"steps_kept": 40, "steps_lost": 1}, {"steps_kept": 40, "steps_lost": 2})
    assert o.accounting(None, {"steps_kept": 40, "steps_lost": 2})


def test_a_floor_of_lost_steps_must_stay_under_the_ledger_and_kept_steps_must_still_match():
    """Seed 7's 200 faults: status counted 293 fewer kept steps than the ledger, from rounds whose every
    member died with its summary. Status now infers their span and says its lost figure is a floor."""
    truth = {"steps_kept": 40, "steps_lost": 3}
    assert o.accounting({"steps_kept": 40, "steps_lost": 2, "steps_lost_lower_bound": True}, truth) == []
    assert o.accounting({"steps_kept": 40, "steps_lost": 4, "steps_lost_lower_bound": True}, truth)
    assert o.accounting({"steps_kept": 39, "steps_lost": 3, "steps_lost_lower_bound": True}, truth)
    assert o.accounting({"steps_kept": 40, "steps_lost": 2}, truth)  # not said to be a floor


def test_anything_left_after_kill_job_is_a_violation():
    assert o.leftovers(Leftovers()) == []
    found = o.leftovers(Leftovers(processes=["123 python -m petctl.agent"], files=["/dev/shm/petctl-snap.x"]))
    assert [v.invariant for v in found] == ["leftovers", "leftovers"]


def test_the_summary_line_has_faults_violations_and_percentiles_per_kind():
    outcomes = [o.Outcome(0, "kill", "recovered", 2.0, 60), o.Outcome(1, "kill", "recovered", 4.0, 60),
                o.Outcome(2, "freeze", "skipped", None, None)]
    line = o.summary_line(7, outcomes, [])
    assert line.startswith("soak seed=7: 2 faults, 0 violations") and "kill=2.0/4.0" in line
    assert o.percentile([1, 2, 3, 4], 50) == 2 and o.percentile([1, 2, 3, 4], 99) == 4


def test_the_interval_in_force_is_the_largest_any_node_of_the_round_set_last():
    from bench.soak import cadence_of

    # Each node says the K in force on it (`every`); the interval a loss may cost is the largest of the
    # round's nodes. A sharded ring's rank's own `proposed` binds nothing until its ring agrees on it.
    events = [({"ts": 1.0, "event": "snapshot.enabled", "step": 0}, "a"),
              ({"ts": 2.0, "event": "snapshot.every", "every": 2, "was": 1}, "a"),
              ({"ts": 2.1, "event": "snapshot.every", "every": 3, "was": 2}, "b"),
              ({"ts": 5.0, "event": "snapshot.every", "every": 7, "was": 3}, "c"),
              ({"ts": 2.2, "event": "snapshot.proposed", "proposed": 9, "was": 3}, "b")]
    cadences = [cadence_of(e, node) for e, node in events]
    assert [c.every for c in cadences] == [1, 2, 3, 7, 1]
    cadences.pop()
    assert o.every_at(cadences, {"a", "b"}, 3.0) == 3
    assert o.every_at(cadences, {"a", "b", "c"}, 4.0) == 3  # c's change came after
    assert o.every_at(cadences, {"a", "b", "c"}, 5.0) == 7
