"""Spot traces: the codec refuses bad files in one line, the plan is the trace in replay time, and the
shipped traces are what the generator makes from their seeds (deterministic) at the rate they claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from petctl.core.errors import ValidationError
from petctl.core.spottrace import NOTICE_GRACE, Trace, TraceEvent, due, pick_slot, plan
from petctl.core.tracegen import SCALE, band_rate, generate

TRACES = Path(__file__).resolve().parents[2] / "bench" / "traces"


def test_codec_round_trips() -> None:
    t = generate("t", "10-15%", seed=3, silent=1 / 3, outage=(1500.0, 600.0), min_gap=90.0)
    assert Trace.from_json(t.to_json()) == t


@pytest.mark.parametrize("text, words", [
    ("not json", "not JSON"),
    ("[]", "expected a JSON object"),
    ('{"nodes": 2, "duration": 10, "events": [{"at": 1, "kind": "boom"}]}', "kind 'boom'"),
    ('{"nodes": 2, "duration": 10, "events": [{"at": 5, "kind": "loss"}, {"at": 1, "kind": "loss"}]}',
     "time order"),
    ('{"nodes": 2, "duration": 10, "events": [{"at": 11, "kind": "loss"}]}', "after the trace's end"),
    ('{"nodes": 2, "duration": 10, "events": [{"at": 1, "kind": "outage"}]}', "needs a duration"),
    ('{"nodes": 2, "events": []}', "missing field 'duration'"),
    ('{"nodes": 2, "duration": 10, "events": [{"at": 1, "kind": "loss", "nod": 1}]}', "unknown fields"),
    ('{"nodes": 0, "duration": 10, "events": []}', "nodes must be >= 1"),
])
def test_bad_traces_are_one_line_errors(text: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words) as info:
        Trace.from_json(text, "f.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("f.json")


def test_plan_is_the_trace_in_replay_time() -> None:
    t = Trace(name="p", nodes=4, duration=1000.0, time_scale=10.0, events=(
        TraceEvent(at=100.0, kind="notice", node=1, return_after=200.0),
        TraceEvent(at=300.0, kind="loss", node=2),
        TraceEvent(at=400.0, kind="rebalance", node=3, grace=60.0),
        TraceEvent(at=600.0, kind="outage", duration=300.0)))
    got = [(a.at, a.what, a.node, a.grace, a.until) for a in plan(t)]
    assert got == [
        (10.0, "hold", 1, 0.0, 10.0 + 12.0 + 20.0),  # held from the notice to reclaim + return_after
        (10.0, "notice", 1, 12.0, 0.0),
        (30.0, "kill", 2, 0.0, 0.0),
        (40.0, "rebalance", 3, 6.0, 0.0),
        (46.0, "notice", 3, NOTICE_GRACE / 10, 0.0),  # the rebalance's notice, same event
        (60.0, "hold", None, 0.0, 60.0 + 12.0 + 30.0),
        (60.0, "notice", None, 12.0, 0.0)]
    actions = plan(t)
    batch, done = due(actions, 0, 30.0)
    assert [a.what for a in batch] == ["hold", "notice", "kill"] and done == 3
    assert due(actions, done, 30.0) == ([], 3)
    assert pick_slot(5, ["a", "b"]) == "b" and pick_slot(0, []) is None


def test_bands_and_scaling() -> None:
    assert band_rate("10-15%") * SCALE == pytest.approx(1.0)
    assert band_rate("<5%") < band_rate("5-10%") < band_rate("15-20%") < band_rate(">20%")
    with pytest.raises(ValidationError, match="unknown interruption band"):
        band_rate("30%")


def test_generator_is_deterministic_and_at_its_rate() -> None:
    a = generate("x", "10-15%", seed=7, silent=1 / 3)
    assert a.to_json() == generate("x", "10-15%", seed=7, silent=1 / 3).to_json()
    assert a.to_json() != generate("x", "10-15%", seed=8, silent=1 / 3).to_json()
    assert a.losses() == 8 and a.rate() == pytest.approx(1.0)  # 8 nodes, 1 simulated hour
    assert a.counts()["loss"] == round(8 / 3)
    reclaims = sorted(e.reclaim_at() for e in a.events)
    assert all(b - x >= 120.0 for x, b in zip(reclaims, reclaims[1:], strict=False))


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_traces_are_what_make_writes(path: Path) -> None:
    from bench.traces.make import traces

    made = {t.name: t.to_json() for t in traces()}
    assert path.read_text() == made[path.stem]
    trace = Trace.from_json(path.read_text(), path.name)
    assert trace.derivation


def test_the_headline_traces() -> None:
    notice = Trace.from_json((TRACES / "spot-10-15-notice.json").read_text())
    mixed = Trace.from_json((TRACES / "spot-10-15-mixed.json").read_text())
    outage = Trace.from_json((TRACES / "spot-15-20-outage.json").read_text())
    assert notice.nodes == 8 and notice.rate() == pytest.approx(1.0) and notice.counts()["loss"] == 0
    assert mixed.counts()["loss"] / mixed.losses() == pytest.approx(1 / 3, abs=0.05)
    assert notice.replay_seconds() <= 400 and "ASSUMPTION" in notice.derivation
    gone = [e for e in outage.events if e.kind == "outage"]
    assert gone and gone[0].duration > 0 and gone[0].capacity_back_at() < outage.duration
    assert json.loads((TRACES / "spot-15-20-outage.json").read_text())["seed"] == 28
