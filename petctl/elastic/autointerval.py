"""`every="auto"`: the decision (`AutoInterval`, a pure function) and its wiring at the edge (`AutoWire`).

`every="auto"`: the durable checkpoint interval, chosen by Young/Daly from measured cost and loss rate.

Two tiers guard a step. The in-memory snapshot (every step, on other nodes) covers the loss of one node;
a spot notice is answered by a save-now. What only the durable store (S3) covers is losing *every holder*
of a step at once, without a notice:
- snapshots off: any node lost silently (rate = nodes x silent rate per node);
- snapshots on, replicated (every node keeps the whole step): all nodes at once (correlated losses, a
  share of the node rate: `CORRELATED_SHARE`, an assumption);
- sharded snapshots (a node keeps its shard and its neighbour's): two neighbours lost within one re-form
  window (2 x nodes x rate^2 x window), plus the correlated rate.
The interval is sqrt(2 x cost x MTBF) (Young 1974; Daly 2006's first-order term) for that MTBF, bounded
to [lo, hi]. Cost is what one save costs: the training thread's stall plus the upload's time. The node
rate starts from a prior (the trace's, or the instance type's Spot Instance Advisor band) worth
`PRIOR_NODE_HOURS` of observation and moves with the job's own losses:
rate = (prior x W + losses) / (W + node_hours).
Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from petctl.core.tracegen import band_rate
from petctl.io.eventlog import EventLog
from petctl.io.files import atomic_write

CORRELATED_SHARE = 0.05  # assumption: 1 loss in 20 takes every node at once (an AZ's capacity going)
PRIOR_NODE_HOURS = 8.0  # the prior counts as this much observation
LO_S, HI_S = 30.0, 3600.0  # default bounds: never more often than 30 s, never less than hourly
CHANGE = 0.2  # a new interval is adopted (and reported) when it differs by more than this fraction


@dataclass(frozen=True)
class LossModel:
    """What the job looks like to the rate that matters."""

    nodes: int
    tier: str = "replicated"  # none | replicated | sharded
    window_s: float = 10.0  # sharded: how long after one loss a second one also loses the step

    def holders_rate(self, node_rate: float) -> float:
        """Events per hour that lose every holder of a step, for `node_rate` silent losses per node-hour."""
        correlated = node_rate * CORRELATED_SHARE
        if self.tier == "none":
            return self.nodes * node_rate
        if self.tier == "sharded":
            return 2.0 * self.nodes * node_rate * node_rate * self.window_s / 3600.0 + correlated
        return correlated


@dataclass(frozen=True)
class Choice:
    seconds: float
    cost_s: float
    holders_rate_per_h: float
    mtbf_s: float
    bound: str  # "" | "lo" | "hi"
    reason: str


def young_daly(cost_s: float, holders_rate_per_h: float, lo: float = LO_S, hi: float = HI_S) -> Choice:
    """sqrt(2 x cost x MTBF), within [lo, hi]. A zero rate or cost goes to a bound (no loss: `hi`)."""
    mtbf = math.inf if holders_rate_per_h <= 0 else 3600.0 / holders_rate_per_h
    raw = math.sqrt(2.0 * max(cost_s, 0.0) * mtbf) if math.isfinite(mtbf) else math.inf
    seconds, bound = (lo, "lo") if raw < lo else (hi, "hi") if raw > hi else (raw, "")
    mtbf_txt = "inf" if not math.isfinite(mtbf) else f"{mtbf:.0f}s"
    reason = (f"young-daly sqrt(2 x {cost_s:.3f}s x MTBF {mtbf_txt}) = "
              + ("inf" if not math.isfinite(raw) else f"{raw:.0f}s")
              + (f", bounded to {seconds:.0f}s ({bound})" if bound else ""))
    return Choice(seconds, cost_s, holders_rate_per_h, mtbf, bound, reason)


@dataclass
class AutoInterval:
    """The running choice: feed it save costs and observed losses; `choice` is the current interval."""

    model: LossModel
    prior_rate: float  # silent node losses per node-hour before any observation
    prior_source: str = "default"
    lo: float = LO_S
    hi: float = HI_S
    losses: int = 0
    node_hours: float = 0.0
    cost_s: float | None = None  # the newest measured save cost (stall + upload)
    choice: Choice | None = None

    def node_rate(self) -> float:
        w = PRIOR_NODE_HOURS
        return (self.prior_rate * w + self.losses) / (w + self.node_hours)

    def observe(self, losses: int, node_hours: float) -> Choice | None:
        """The job's own count so far (totals, not increments). Returns the new choice when it changed."""
        self.losses, self.node_hours = max(0, losses), max(0.0, node_hours)
        return self._update()

    def saved(self, stall_s: float, upload_s: float) -> Choice | None:
        """One save's measured cost. Returns the new choice when it changed."""
        self.cost_s = max(0.0, stall_s) + max(0.0, upload_s)
        return self._update()

    def _update(self) -> Choice | None:
        if self.cost_s is None:
            return None
        new = young_daly(self.cost_s, self.model.holders_rate(self.node_rate()), self.lo, self.hi)
        old = self.choice
        if old is not None and abs(new.seconds - old.seconds) <= CHANGE * old.seconds:
            return None
        self.choice = new
        return new

    def fields(self) -> dict[str, object]:
        """The structured event's fields (`checkpoint.interval`)."""
        c = self.choice
        assert c is not None
        return {"interval_s": round(c.seconds, 1), "cost_s": round(c.cost_s, 4),
                "holders_rate_per_h": round(c.holders_rate_per_h, 6),
                "mtbf_s": None if not math.isfinite(c.mtbf_s) else round(c.mtbf_s, 1), "bound": c.bound,
                "tier": self.model.tier, "nodes": self.model.nodes,
                "node_rate_per_h": round(self.node_rate(), 5),
                "prior_rate_per_h": self.prior_rate, "prior": self.prior_source, "losses": self.losses,
                "node_hours": round(self.node_hours, 3), "reason": c.reason}


# --- AutoWire: every='auto' at the edge ---------------------------------------------------------------------
# `every="auto"` at the edge: the prior from the environment, the job's own losses from a node-local
# ledger, and the `checkpoint.interval` event (autointerval.py holds the decision).
#
# Prior, in order: `$PETCTL_LOSS_RATE` (silent losses per node-hour, e.g. from a spot trace), else
# `$PETCTL_SPOT_BAND` (a Spot Instance Advisor band; every interruption counted as possibly silent, since
# notices are best effort), else the 10-15 % band. Observed: a worker that resumes from an in-memory
# snapshot lost a node without a notice (a notice is answered by a durable save-now, so the store would
# have been as new); the ledger (`auto-interval.json` in the agent's control directory) carries the count
# and the node-hours seen across the worker restarts of a node. Without a control directory (no agent)
# the count lives as long as the process.


LEDGER = "auto-interval.json"
DEFAULT_BAND = "10-15%"


def prior_from_env(env: dict[str, str] | None = None) -> tuple[float, str]:
    """(silent losses per node-hour, where that came from). A bad value is a ValueError naming it."""
    env = dict(os.environ) if env is None else env
    if env.get("PETCTL_LOSS_RATE"):
        try:
            rate = float(env["PETCTL_LOSS_RATE"])
        except ValueError:
            raise ValueError(f"PETCTL_LOSS_RATE must be a number (losses per node-hour), "
                             f"not {env['PETCTL_LOSS_RATE']!r}") from None
        return max(rate, 0.0), "PETCTL_LOSS_RATE"
    band = env.get("PETCTL_SPOT_BAND") or DEFAULT_BAND
    return band_rate(band), f"band {band}"


class AutoWire:
    """One checkpointer's auto interval: measures, observes, decides, reports."""

    def __init__(self, nodes: int, tier: str, log: EventLog, control_dir: Path | None,
                 report: bool = True, clock=time.time) -> None:
        rate, source = prior_from_env()
        self.auto = AutoInterval(LossModel(nodes=max(1, nodes), tier=tier), rate, source)
        self.log = log
        self.report = report  # one rank speaks (the others keep the same interval silently)
        self.clock = clock
        self.path = control_dir / LEDGER if control_dir else None
        self.ledger = self._read()

    @property
    def seconds(self) -> float:
        """The interval now: the lower bound until the first save was measured."""
        return self.auto.choice.seconds if self.auto.choice else self.auto.lo

    def resumed(self, source: str, world_size: int) -> None:
        """A worker resumed (from `source`): count the node-hours since the last word, and a silent loss
        when it came from a snapshot."""
        self._advance(world_size)
        if source == "snapshot":
            self.ledger["losses"] = int(self.ledger.get("losses", 0)) + 1
        self._write()
        self._report(self.auto.observe(self.ledger["losses"], self.ledger["node_s"] / 3600.0))

    def saved(self, stall_s: float, upload_s: float, world_size: int) -> None:
        self._advance(world_size)
        self.auto.observe(int(self.ledger.get("losses", 0)), self.ledger["node_s"] / 3600.0)
        self._report(self.auto.saved(stall_s, upload_s))

    def _advance(self, world_size: int) -> None:
        now = self.clock()
        last = float(self.ledger.get("last", now))
        self.ledger["node_s"] = float(self.ledger.get("node_s", 0.0)) + max(0.0, now - last) * int(
            self.ledger.get("world", world_size))
        self.ledger["last"], self.ledger["world"] = now, world_size
        self.ledger.setdefault("losses", 0)

    def _report(self, choice) -> None:
        if choice is not None and self.report:
            self.log.emit("checkpoint.interval", **self.auto.fields())

    def _read(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            return dict(json.loads(self.path.read_text()))
        except (OSError, ValueError) as e:  # a torn ledger costs the history, not the job: say so once
            self.log.emit("checkpoint.interval_ledger_unreadable", path=str(self.path), error=repr(e))
            return {}

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            atomic_write(self.path, json.dumps(self.ledger))
        except OSError as e:
            self.log.emit("checkpoint.interval_ledger_unwritable", path=str(self.path), error=repr(e))
