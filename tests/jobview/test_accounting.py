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


def unseen_round_timeline(resume_at: int) -> list[dict]:
    """Round 1 (a, b) trains 0..10; b is lost and round 2 (a alone) resumes at 8 from a save at 7, saves 19,
    and a dies with it, writing no summary; round 3 (c, a replacement) resumes at `resume_at`."""
    events = timeline()[:5]  # round 1, b's loss, the restart that opened round 2
    events += [ev(12.5, "workers.started", "a", round=2, rank=0, world_size=1),
               ev(12.8, "checkpoint.loaded", "a", round=2, step=7, rank=0),
               ev(24.0, "checkpoint.saved", "a", round=2, step=19, rank=0),
               ev(40, "agent.started", "c"),
               ev(41, "rendezvous.restart", "c", round=3, cause="node lost: a", failure=False),
               ev(42, "workers.started", "c", round=3, rank=0, world_size=1),
               summary(60, "c", 3, 0, 1, resume_at, 40, 43.0, 60.0)]
    return events


def test_a_round_that_died_with_every_member_keeps_the_steps_the_next_round_resumed_after():
    """Seed 7's soak: status counted 293 kept steps fewer than the ledger, every one in rounds whose
    members all died before their summary. Their workers' loads and saves (stamped with the round by the
    agent) say where they started and how far they got at least."""
    acc = account(unseen_round_timeline(resume_at=23))
    r1, r2, r3 = acc.rounds
    assert r2.unseen and (r2.first_step, r2.last_step) == (8, 22)  # it ran at least to 22: 23 resumed
    assert (r1.kept_steps, r1.steps_lost) == (8, 3)
    assert (r2.kept_steps, r2.steps_lost) == (15, 0)  # 8..22
    assert (r3.kept_steps, r3.steps_lost) == (18, 0)  # 23..40
    assert acc.steps_kept == 41 and acc.steps_lost == 3  # steps 0..40, each kept once
    assert acc.steps_lost_lower_bound  # what round 2 ran past 22 is not known
    assert r2.kept_node_seconds == 15 * 1.0 * 1  # its world size's step time in the rounds seen
    # The next round resumed from the durable save at 19: the steps past it that round 2 ran are lost, of
    # which status knows none (no step after 19 was seen); steps 0..40 are still each kept once.
    acc = account(unseen_round_timeline(resume_at=20))
    assert (acc.steps_kept, acc.steps_lost, acc.rounds[1].last_step) == (41, 3, 19)
    assert acc.steps_lost_lower_bound
    assert "steps_lost_lower_bound" in acc.to_dict()


def test_no_floor_when_every_round_that_ended_wrote_its_summary():
    assert not account(timeline()).steps_lost_lower_bound
