"""Goodput, lost steps and re-forming time from a hand-built timeline with known answers."""

from petctl.jobview.accounting import account


def ev(ts, event, node, **fields):
    return {"ts": ts, "event": event, "node": node, **fields}


def summary(ts, node, rnd, rank, world, first, last, first_ts, last_ts):
    return ev(ts, "round.summary", node, round=rnd, rank=rank, world_size=world, started=first_ts - 1,
              ended=ts, first_step=first, last_step=last, first_step_ts=first_ts, last_step_ts=last_ts)


def timeline():
    # Two nodes train steps 0..10 (1 s each) in round 1; b is lost; the checkpoint was at step 7, so
    # round 2 (a alone) resumes at 8 and trains 8..20; then a exits after success.
    return [
        ev(0, "agent.started", "a"), ev(0, "agent.started", "b"),
        summary(12, "a", 1, 0, 2, 0, 10, 1.0, 11.0),
        summary(12, "b", 1, 1, 2, 0, 10, 1.0, 11.0),
        ev(11.5, "membership.lost", "a"),
        ev(11.6, "rendezvous.restart", "a", round=2, cause="node lost: b", failure=False),
        summary(30, "a", 2, 0, 1, 8, 20, 14.0, 26.0),
        ev(31, "agent.exit", "a", state="succeeded"),
    ]


def test_lost_steps_kept_steps_and_reform_time():
    acc = account(timeline())
    r1, r2 = acc.rounds
    assert (r1.kept_steps, r1.steps_lost) == (8, 3)  # steps 0..7 kept, 8..10 redone
    assert (r2.kept_steps, r2.steps_lost) == (13, 0)
    assert acc.steps_lost == 3 and acc.steps_kept == 21
    assert acc.reform_seconds == 14.0 - 11.0
    assert acc.reforms == 1 and acc.failure_restarts == 0
    assert r2.cause == "node lost: b"


def test_goodput_is_kept_node_seconds_over_instance_seconds():
    acc = account(timeline())
    # kept: 8 steps x 1 s x 2 nodes + 13 steps x 1 s x 1 node = 29 node-seconds
    assert acc.kept_node_seconds == 29.0
    # a: 0 -> 31 (exit); b: 0 -> 12 (its last word, a summary) = 43 node-seconds
    assert acc.instance_seconds == 43.0 and acc.nodes == 2
    assert abs(acc.goodput - 29.0 / 43.0) < 1e-9


def test_duplicates_from_two_sources_count_once_and_order_does_not_matter():
    events = timeline()
    assert account(list(reversed(events)) + events).to_dict() == account(events).to_dict()


def test_running_job_counts_uptime_until_now():
    events = [ev(0, "agent.started", "a"), summary(10, "a", 1, 0, 1, 0, 9, 1.0, 10.0)]
    assert account(events, now=100.0).instance_seconds == 100.0


def test_rounds_that_never_trained_fall_inside_the_reform_gap():
    events = timeline()
    # Round 2 re-formed again before its first step; round 3 (a alone) trains.
    events = [e for e in events if not (e["event"] == "round.summary" and e["round"] == 2)]
    events += [ev(13, "round.summary", "a", round=2, rank=0, world_size=1, started=12.5, ended=13,
                  first_step=None, last_step=None, first_step_ts=None, last_step_ts=None),
               summary(30, "a", 3, 0, 1, 8, 20, 14.0, 26.0)]
    acc = account(events)
    assert acc.reform_seconds == 14.0 - 11.0 and acc.steps_lost == 3


def test_a_script_that_reports_no_steps_has_no_goodput_rather_than_zero():
    """A plain torchrun script prints no train.step lines: its rounds have no step span. It trained all
    along, so "goodput 0%" would be false: goodput is n/a, and the summary line says why."""
    from petctl.jobview.summary import one_line

    def stepless(node: str, rank: int) -> dict:
        return ev(50, "round.summary", node, round=1, rank=rank, world_size=2, started=1.0, ended=50,
                  first_step=None, last_step=None, first_step_ts=None, last_step_ts=None)

    events = [ev(0, "agent.started", "a"), ev(0, "agent.started", "b"), stepless("a", 0), stepless("b", 1)]
    acc = account(events, now=60.0)
    assert acc.instance_seconds == 120.0 and not acc.steps_reported
    assert acc.goodput is None
    assert "no training steps" in acc.goodput_note
    line = one_line({**acc.to_dict(), "instance_hours": acc.instance_seconds / 3600, "cost": None})
    assert line.startswith("goodput n/a (the script reports no training steps")
    assert "steps lost n/a" in line and "0 steps lost" not in line
    # As soon as any round reports a step, goodput is a number again.
    assert account(timeline()).goodput is not None and account(timeline()).goodput_note == ""
