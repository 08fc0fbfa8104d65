"""What a job cost, and what the same instance hours would have cost on demand.

Usage is every billed second: each instance from its launch to its end as the provider recorded it
(accounting.py `instance_spans`), its type, market and AZ the provider's or, failing that, its agent's
`agent.started` (read from the metadata service); an instance the provider has no record of counts from
its agent's start to its exit or last word. Prices come from a provider-specific `Prices` (AWS: spot
price history and the Price List API, see providers/aws/pricing.py). Every figure says whether it is an
estimate: spot is billed per second at the price of the moment, which the history only approximates; the
bill is authoritative.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from petctl.jobview.accounting import BilledSpan, billing_basis, instance_spans


@dataclass(frozen=True)
class UsageKey:
    instance_type: str
    market: str  # spot | on-demand
    az: str


@dataclass
class Quote:
    price: float | None  # USD per instance-hour; None when no price could be found
    estimate: bool = True
    source: str = ""


class Prices(Protocol):
    def quote(self, key: UsageKey, start: float, end: float) -> Quote: ...

    def on_demand(self, instance_type: str) -> Quote: ...


@dataclass
class CostLine:
    instance_type: str
    market: str
    az: str
    hours: float
    price: float | None
    cost: float | None
    on_demand_price: float | None
    on_demand_cost: float | None
    estimate: bool
    source: str


@dataclass
class CostReport:
    lines: list[CostLine] = field(default_factory=list)
    total: float | None = None
    on_demand_total: float | None = None
    estimate: bool = False
    note: str = ""
    billing_basis: str = "agents"  # where the hours came from (accounting.py `billing_basis`)

    @property
    def saving(self) -> float | None:
        if self.total is None or self.on_demand_total is None:
            return None
        return self.on_demand_total - self.total

    @property
    def saving_pct(self) -> float | None:
        if self.saving is None or not self.on_demand_total:
            return None
        return self.saving / self.on_demand_total

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saving": self.saving, "saving_pct": self.saving_pct}


def usage(events: Iterable[dict[str, Any]], now: float | None = None,
          billed: Iterable[BilledSpan] | None = None) -> list[tuple[UsageKey, float, float]]:
    """(what, start, end) per instance's billed span; instances without an identity (local) are skipped."""
    return [(key, start, end) for key, start, end, _ in _usage(events, now, billed)]


def _usage(events: Iterable[dict[str, Any]], now: float | None,
           billed: Iterable[BilledSpan] | None) -> list[tuple[UsageKey, float, float, str]]:
    out = []
    for span in instance_spans(events, billed, now):
        identity = span.identity
        if identity.get("instance_type"):
            market = "spot" if identity.get("market") == "spot" else "on-demand"
            key = UsageKey(identity["instance_type"], market, identity.get("az", ""))
            out.append((key, span.start, span.end, span.basis))
    return out


def billed_usage(events: Iterable[dict[str, Any]], now: float | None, billed: Iterable[BilledSpan] | None,
                 prices: Prices) -> CostReport:
    """`price_usage` of the job's billed spans, saying where the hours came from."""
    found = _usage(events, now, billed)
    report = price_usage([(key, start, end) for key, start, end, _ in found], prices)
    report.billing_basis = billing_basis(basis for *_, basis in found)
    return report


def price_usage(spans: list[tuple[UsageKey, float, float]], prices: Prices) -> CostReport:
    merged: dict[UsageKey, CostLine] = {}
    for key, start, end in spans:
        hours = max(0.0, end - start) / 3600.0
        quote, od = prices.quote(key, start, end), prices.on_demand(key.instance_type)
        line = merged.get(key)
        if line is None:
            line = merged[key] = CostLine(key.instance_type, key.market, key.az, 0.0, quote.price, 0.0,
                                          od.price, 0.0, quote.estimate or od.estimate, quote.source)
        line.hours += hours
        line.cost = None if quote.price is None or line.cost is None else line.cost + hours * quote.price
        line.on_demand_cost = (None if od.price is None or line.on_demand_cost is None
                               else line.on_demand_cost + hours * od.price)
    report = CostReport(lines=sorted(merged.values(), key=lambda x: (x.instance_type, x.market, x.az)))
    if not report.lines:
        report.note = "no priced instances (the local provider costs nothing)"
        return report
    costs = [x.cost for x in report.lines]
    on_demand = [x.on_demand_cost for x in report.lines]
    report.total = None if None in costs else sum(costs)  # type: ignore[arg-type]
    report.on_demand_total = None if None in on_demand else sum(on_demand)  # type: ignore[arg-type]
    report.estimate = any(x.estimate for x in report.lines)
    if report.total is None:
        report.note = "some prices could not be found; see the lines without a price"
    elif report.estimate:
        report.note = "estimate from published prices (spot: price history over each instance's life)"
    return report
