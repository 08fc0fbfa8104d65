"""Cost arithmetic on usage from agent events, with prices from a fake `Prices` (no AWS involved)."""

from petctl.jobview.cost import Quote, UsageKey, price_usage, usage


class FakePrices:
    def __init__(self, spot=0.3, on_demand=1.0):
        self.spot, self.od = spot, on_demand

    def quote(self, key, start, end):
        if key.market == "spot":
            return Quote(self.spot, True, "fake spot")
        return self.on_demand(key.instance_type)

    def on_demand(self, instance_type):
        return Quote(self.od, False, "fake list") if self.od is not None else Quote(None, True, "none")


def started(ts, node, market="spot", itype="g5.xlarge", az="us-east-1a"):
    return {"ts": ts, "event": "agent.started", "node": node, "instance_type": itype, "market": market,
            "az": az}


EVENTS = [
    started(0, "a"), {"ts": 7200, "event": "agent.exit", "node": "a"},           # 2 h spot
    started(0, "b"), {"ts": 3600, "event": "membership.lost", "node": "b"},      # 1 h spot, then vanished
    started(0, "c", market="on-demand"), {"ts": 3600, "event": "agent.left", "node": "c"},  # 1 h on demand
    {"ts": 0, "event": "agent.started", "node": "local-1"},                       # no identity: not billed
]


def test_usage_comes_from_agent_lifetimes_with_identity():
    spans = usage(EVENTS)
    assert sorted((k.market, end - start) for k, start, end in spans) == [
        ("on-demand", 3600), ("spot", 3600), ("spot", 7200)]


def test_cost_total_on_demand_comparison_and_saving():
    report = price_usage(usage(EVENTS), FakePrices(spot=0.3, on_demand=1.0))
    spot = next(x for x in report.lines if x.market == "spot")
    assert spot.hours == 3.0 and abs(spot.cost - 0.9) < 1e-9 and spot.on_demand_cost == 3.0
    assert abs(report.total - 1.9) < 1e-9 and report.on_demand_total == 4.0
    assert abs(report.saving - 2.1) < 1e-9 and abs(report.saving_pct - 0.525) < 1e-9
    assert report.estimate and "estimate" in report.note


def test_missing_price_is_unknown_not_zero():
    report = price_usage(usage(EVENTS), FakePrices(on_demand=None))
    assert report.total is None and report.on_demand_total is None and "could not be found" in report.note


def test_local_jobs_cost_nothing():
    report = price_usage(usage([EVENTS[-1]]), FakePrices())
    assert report.lines == [] and report.total is None and "local" in report.note


def test_key_is_hashable_and_merges_lines():
    spans = usage(EVENTS[:4])
    assert len({k for k, _, _ in spans}) == 1 and spans[0][0] == UsageKey("g5.xlarge", "spot", "us-east-1a")
