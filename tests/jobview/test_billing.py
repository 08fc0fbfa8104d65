"""Issue 43: every billed second is counted. Instance time runs from the provider's launch of each instance
to its termination or reclaim, not from its agent's start to its leave; the agents' span stands in only
for an instance the provider has no record of, and `billing_basis` says which was used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from petctl.jobview.accounting import BilledSpan, account, instance_spans
from petctl.jobview.cost import Quote, UsageKey, billed_usage, usage
from petctl.jobview.summary import one_line
from petctl.providers.local.jobdir import JobDir
from petctl.providers.local.provider import billed


def ev(ts: float, event: str, **kw) -> dict:
    return {"ts": ts, "event": event, **kw}


# a: launched at 0, booted 5 s (agent from 5), left at 50, reclaimed at 62 (the notice's window after the
# leave). b: launched at 0, agent at 0.5, still running. c: detached at 30, left at 40, exited at 41.
EVENTS = [ev(5, "agent.started", node="a", instance_type="g5.xlarge", market="spot", az="us-east-1a"),
          ev(0.5, "agent.started", node="b"), ev(10, "agent.started", node="c"),
          ev(50, "agent.left", node="a"), ev(40, "agent.left", node="c")]
BILLED = [BilledSpan("a", 0.0, 62.0), BilledSpan("b", 0.0, None), BilledSpan("c", 8.0, 41.0)]


def test_the_boot_and_the_window_after_the_leave_are_billed() -> None:
    spans = {s.node: s for s in instance_spans(EVENTS, BILLED, now=100.0)}
    assert (spans["a"].start, spans["a"].end) == (0.0, 62.0)  # 5 s of boot and 12 s after its leave
    assert (spans["b"].start, spans["b"].end) == (0.0, 100.0)  # running: to now
    assert (spans["c"].start, spans["c"].end) == (8.0, 41.0)  # detached: until its exit
    acc = account(EVENTS, now=100.0, billed=BILLED)
    assert acc.instance_seconds == pytest.approx(62.0 + 100.0 + 33.0)
    assert acc.billing_basis == "provider" and acc.nodes == 3
    # The agents' figure it replaces: 45 + 99.5 + 30.
    assert account(EVENTS, now=100.0).instance_seconds == pytest.approx(45.0 + 99.5 + 30.0)


def test_an_instance_booted_five_seconds_before_its_agent_is_billed_those_seconds() -> None:
    events = [ev(105.0, "agent.started", node="r"), ev(130.0, "agent.exit", node="r")]
    with_boot = account(events, billed=[BilledSpan("r", 100.0, 130.0)])
    agents_only = account(events)
    assert with_boot.instance_seconds - agents_only.instance_seconds == pytest.approx(5.0)
    assert (with_boot.billing_basis, agents_only.billing_basis) == ("provider", "agents")


def test_the_agents_span_stands_in_only_where_the_provider_has_no_record() -> None:
    acc = account(EVENTS, now=100.0, billed=BILLED[:1])
    assert acc.billing_basis == "provider+agents"
    assert acc.instance_seconds == pytest.approx(62.0 + 99.5 + 30.0)
    # Recorded but never ended (its reconciler was lost) and the job over: to its agent's last word.
    acc = account(EVENTS, billed=[BilledSpan("a", 0.0, None)])
    assert {s.node: s.end for s in instance_spans(EVENTS, [BilledSpan("a", 0.0, None)])}["a"] == 50.0
    # An instance that never started its agent (stopped while booting) is billed all the same.
    acc = account([], billed=[BilledSpan("z", 10.0, 13.0)])
    assert acc.instance_seconds == pytest.approx(3.0) and acc.nodes == 1


def test_status_line_says_what_the_instance_time_counts() -> None:
    acc = account(EVENTS, now=100.0, billed=BILLED)
    line = one_line({**acc.to_dict(), "instance_hours": acc.instance_seconds / 3600, "cost": None})
    assert "instance-hours (launch to end)" in line
    acc = account(EVENTS, now=100.0)
    line = one_line({**acc.to_dict(), "instance_hours": acc.instance_seconds / 3600, "cost": None})
    assert "instance-hours (agent uptime: the provider has no record" in line


class FlatPrices:
    def quote(self, key: UsageKey, start: float, end: float) -> Quote:
        return Quote(3.6, estimate=False, source="flat")

    def on_demand(self, instance_type: str) -> Quote:
        return Quote(36.0, estimate=False, source="flat")


def test_cost_prices_the_billed_span_with_the_providers_identity_first() -> None:
    billed_spans = [BilledSpan("a", 0.0, 62.0),  # identity from its agent's start event
                    BilledSpan("z", 0.0, 10.0, "g5.xlarge", "spot", "us-east-1a")]  # never started an agent
    assert usage(EVENTS, 100.0, billed_spans)[0][1:] == (0.0, 62.0)
    report = billed_usage(EVENTS, 100.0, billed_spans, FlatPrices())
    (line,) = report.lines
    assert line.hours == pytest.approx(72.0 / 3600) and report.total == pytest.approx(72.0 / 3600 * 3.6)
    assert report.billing_basis == "provider"  # of what was priced (b and c have no type: unpriced)


def test_the_local_record_is_read_from_instances_json(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "job")
    job.path.mkdir()
    job.write_instances([
        {"id": "i-a", "pid": 0, "start": None, "launched_at": 1.0, "state": "terminated", "ended_at": 9.0,
         "booted_at": None, "reason": "job killed while booting"},
        {"id": "i-b", "pid": 42, "start": 7, "launched_at": 2.0, "state": "running", "ended_at": None},
        {"id": "i-old", "pid": 43, "start": 7, "state": "terminated"}])  # no launch recorded: skipped
    assert billed(job) == [BilledSpan("i-a", 1.0, 9.0), BilledSpan("i-b", 2.0, None)]
    assert json.loads(job.instances_path.read_text())[0]["reason"] == "job killed while booting"
