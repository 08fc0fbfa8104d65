"""`petctl status` and `petctl report` say only what they know (issue 15), checked over a hand-built
timeline and status dict with known answers: no etcd, no agents.

- Two counts that were both called "restarts": failure restarts (the round's count, bounded by
  --max-restarts) and re-forms (every round opened after the first, membership changes included).
- A plain script prints no `train.step` lines: step, goodput and steps lost are `n/a` (null in JSON),
  never 0; what the agents observe themselves (re-forms, re-forming time) is still shown.
"""

from __future__ import annotations

import pytest

from petctl.cli.insight import report_rows
from petctl.cli.render import status_summary
from petctl.cli.status import job_status, node_rows
from petctl.core.records import Phase, Round
from petctl.jobview.accounting import NO_STEPS, account
from petctl.jobview.live import JobState
from petctl.jobview.report import headline
from petctl.jobview.summary import one_line, summarize
from petctl.providers.base import JobInfo


def ev(ts, event, node, **fields):
    return {"ts": ts, "event": event, "node": node, **fields}


def stepless_summary(node, rnd, world, started, ended):
    return ev(ended, "round.summary", node, round=rnd, rank=0, world_size=world, started=started, ended=ended,
              first_step=None, last_step=None, first_step_ts=None, last_step_ts=None)


def plain_job():
    """A plain script (no step lines) on nodes a and b. b is SIGKILLed at 30: a's workers fail at 31, b is
    judged lost at 35 (round 2, a alone, workers at 37); a worker failure at 50 (round 3, a failure restart,
    workers at 55); c joins (round 4 at 75, workers at 77.5), still running."""
    return [
        ev(0, "agent.started", "a"), ev(0, "agent.started", "b"),
        ev(5, "workers.started", "a", round=1, rank=0, world_size=2),
        ev(5.1, "workers.started", "b", round=1, rank=1, world_size=2),
        ev(31, "workers.failed", "a", round=1, local_rank=0, code=1),
        ev(35, "membership.lost", "a", round=1, nodes=["b"]),
        ev(35.1, "rendezvous.restart", "a", round=2, cause="node lost: b", failure=False, restarts=0),
        stepless_summary("a", 1, 2, 5, 36),
        ev(37, "workers.started", "a", round=2, rank=0, world_size=1),
        ev(50, "workers.failed", "a", round=2, local_rank=0, code=1),
        ev(53.2, "rendezvous.restart", "a", round=3, cause="worker failure on a", failure=True, restarts=1),
        stepless_summary("a", 2, 1, 37, 54),
        ev(55, "workers.started", "a", round=3, rank=0, world_size=1),
        ev(70, "agent.started", "c"),
        ev(75, "rendezvous.restart", "a", round=4, cause="scale-up: c", failure=False, restarts=1),
        stepless_summary("a", 3, 1, 55, 76),
        ev(77.5, "workers.started", "a", round=4, rank=0, world_size=2),
        ev(77.6, "workers.started", "c", round=4, rank=1, world_size=2),
    ]


# From the end of training (the first worker failure, or the round being replaced) to the next round's
# workers starting: 37 - 31, 55 - 50, 77.5 - 75.
PLAIN_REFORM_SECONDS = 6.0 + 5.0 + 2.5


class FakeView:
    """What `summarize` reads of a `JobView`."""

    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events

    def accounting(self, events, running):
        return account(events, now=100.0 if running else None)

    def cost(self, events, running):
        return None


def node(node_id, rank, step=None):
    return {"node_id": node_id, "rank": rank, "world_size": 2, "round": 4, "restarts": 1, "state": "running",
            "step": step, "last_checkpoint": None, "failures": {}}


def status_of(events, steps=(None, None)):
    """What `petctl status -o json` holds for the plain job (round 4, one failure restart so far)."""
    info = JobInfo(name="plain", state="running", min_size=1, max_size=3, desired=2, created_at=0.0,
                   provider="local")
    rnd = Round(round=4, phase=Phase.FROZEN, ts=77.0, ranks={"a": 0, "c": 1}, world_size=2, restarts=1)
    state = JobState(job="plain", round=rnd)
    data = job_status(info, state)
    data["nodes"] = {"a": node("a", 0, steps[0]), "c": node("c", 1, steps[1])}
    live = any(s is not None for s in steps)
    data["accounting"] = summarize(FakeView(events), running=True, live_steps=live)
    return data


# --- 1. which "restarts" is which ------------------------------------------------------------------------
def test_the_header_counts_failure_restarts_and_the_summary_counts_re_forms():
    data = status_of(plain_job())
    header, line = status_summary(data), one_line(data["accounting"])
    assert header == "job plain: running, round 4, world size 2, desired 2 in [1, 3], failure restarts 1"
    assert "3 re-forms (1 failure restart)" in line and "restarts," not in line
    columns, _ = node_rows(data)
    assert "failure restarts" in columns and "restarts" not in columns


def test_json_names_both_counts_and_restarts_means_failure_restarts_only():
    data = status_of(plain_job())
    assert (data["failure_restarts"], data["restarts"]) == (1, 1)  # the round's failure count, both names
    acc = data["accounting"]
    assert (acc["reforms"], acc["failure_restarts"]) == (3, 1) and "restarts" not in acc
    report = account(plain_job(), now=100.0).to_dict()
    assert (report["reforms"], report["failure_restarts"]) == (3, 1) and "restarts" not in report


def test_the_report_names_both_counts():
    rows = dict(report_rows(account(plain_job(), now=100.0)))
    assert rows["re-forms (membership changes and failure restarts)"] == 3
    assert rows["failure restarts (counted against --max-restarts)"] == 1
    assert not any(label.startswith("restarts") for label in rows)
    assert "3 re-forms (1 failure restart)" in headline("plain", account(plain_job(), now=100.0))


@pytest.mark.parametrize("reforms,failures,text", [
    (0, 0, "0 re-forms"), (1, 0, "1 re-form"), (3, 1, "3 re-forms (1 failure restart)"),
    (4, 2, "4 re-forms (2 failure restarts)"),
])
def test_re_form_wording(reforms, failures, text):
    summary = {"goodput": None, "steps_reported": False, "steps_lost": None, "reforms": reforms,
               "failure_restarts": failures, "reform_seconds": 0.0, "instance_hours": 0.0, "cost": None}
    assert f", {text}, " in one_line(summary)


# --- 2. no steps: n/a for what is unknown, the agents' own events for the rest ---------------------------
def test_a_plain_job_re_forms_are_timed_from_the_agents_events():
    acc = account(plain_job(), now=100.0)
    assert not acc.steps_reported
    assert acc.reform_seconds == pytest.approx(PLAIN_REFORM_SECONDS)
    assert acc.reform_basis == "rounds"
    assert [(r.round, r.ended) for r in acc.rounds] == [(1, 36), (2, 54), (3, 76), (4, None)]  # 4 runs


def test_a_plain_job_re_form_time_counts_without_a_failure_or_a_summary():
    """The round's end is the earliest sign of it: a failure, the restart that replaced it, or its
    summary; a round killed with every member (no summary) still ends at its replacement."""
    events = [e for e in plain_job() if e["event"] != "workers.failed"]
    assert account(events, now=100.0).reform_seconds == pytest.approx((37 - 35.1) + (55 - 53.2) + 2.5)
    events = [e for e in events if not (e["event"] == "round.summary" and e["round"] == 3)]
    assert account(events, now=100.0).reform_seconds == pytest.approx((37 - 35.1) + (55 - 53.2) + 2.5)


def test_a_plain_job_status_says_n_a_for_steps_goodput_and_lost_steps():
    data = status_of(plain_job())
    acc = data["accounting"]
    assert (acc["goodput"], acc["steps_lost"], acc["steps_kept"], acc["steps_reported"]) == (
        None, None, None, False)
    assert acc["goodput_note"] == NO_STEPS
    line = one_line(acc)
    assert line.startswith("goodput n/a (") and ", steps lost n/a, " in line
    assert "0%" not in line and "0 steps lost" not in line
    # Issue 25, defect 5: only the workers' restart is seen, not training again: a lower bound, so named.
    bound = f"≥{PLAIN_REFORM_SECONDS:.1f}s re-forming (lower bound: until workers restarted, not training)"
    assert bound in line
    assert acc["reform_lower_bound"] is True
    _, rows = node_rows(data)
    assert [row[6] for row in rows] == ["n/a", "n/a"]  # the step column


def test_a_plain_job_report_says_n_a():
    acc = account(plain_job(), now=100.0)
    rows = dict(report_rows(acc))
    assert rows["steps kept / lost"] == "n/a"
    assert rows["goodput (kept node-time / instance node-time)"].startswith("n/a (")
    assert rows["time re-forming"].startswith(f"≥{PLAIN_REFORM_SECONDS:.1f}s (a lower bound: round end to "
                                              "workers restarted")
    assert f"≥{PLAIN_REFORM_SECONDS:.1f}s re-forming" in headline("plain", acc)
    assert (acc.to_dict()["steps_lost"], acc.to_dict()["steps_kept"]) == (None, None)
    assert "steps lost n/a" in headline("plain", acc) and "goodput n/a" in headline("plain", acc)


def test_steps_seen_live_are_not_called_missing():
    """A script that prints steps, in its first round: no round has ended, so goodput waits for one, but
    status must not say the script reports no steps while the step column shows them."""
    events = [ev(0, "agent.started", "a"), ev(1, "workers.started", "a", round=1, rank=0, world_size=1)]
    data = status_of(events, steps=(42, 42))
    acc = data["accounting"]
    assert acc["steps_reported"] is True and acc["goodput"] is None
    assert acc["goodput_note"] != NO_STEPS and "round" in acc["goodput_note"]
    assert acc["steps_lost"] == 0  # nothing redone yet: no round has re-formed
    _, rows = node_rows(data)
    assert [row[6] for row in rows] == [42, 42]


def test_a_job_that_reports_steps_keeps_its_step_based_re_forming():
    """With step lines, re-forming is last step to next first step, as before
    (tests/jobview/test_accounting.py)."""
    def summary(ts, rnd, first, last, first_ts, last_ts):
        return ev(ts, "round.summary", "a", round=rnd, rank=0, world_size=1, started=first_ts - 1, ended=ts,
                  first_step=first, last_step=last, first_step_ts=first_ts, last_step_ts=last_ts)

    events = [ev(0, "agent.started", "a"), summary(12, 1, 0, 10, 1.0, 11.0),
              ev(11.6, "rendezvous.restart", "a", round=2, cause="x", failure=False),
              summary(30, 2, 8, 20, 14.0, 26.0)]
    acc = account(events)
    assert (acc.reform_seconds, acc.reform_basis, acc.steps_lost) == (3.0, "steps", 3)
    assert acc.to_dict()["reform_lower_bound"] is False
    line = one_line({**acc.to_dict(), "instance_hours": 0.0, "cost": None})
    assert ", 3.0s re-forming," in line and "≥" not in line
