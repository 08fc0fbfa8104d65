"""Seeded spot traces from AWS's published interruption-frequency bands.

The Spot Instance Advisor publishes, per instance type and region, a "frequency of interruption": the rate
at which Spot reclaimed capacity during the trailing month, in the bands <5 %, 5-10 %, 10-15 %, 15-20 %
and >20 %. Nothing finer is published, so a trace is derived from a band with these assumptions (each is
written into the trace's `derivation`):

1. A band stands for its midpoint (<5 %: 2.5 %; >20 %: 25 %) of instances reclaimed per month (730 h),
   as a constant hazard: lambda = -ln(1 - p) / 730 per node-hour (10-15 %: 1.8e-4).
2. Scaling: that rate is multiplied by one factor, `SCALE`, chosen so the 10-15 % band gives 1 loss per
   node-hour, so that a 15-minute benchmark sees several losses. The other bands keep their ratio to it.
   The real rates are ~5000x lower; what the benchmark measures is the cost of each loss, and a goodput
   at that (pessimistic) rate.
3. Given the expected count n = rate x node-hours (rounded), the n losses fall uniformly in time (a Poisson
   process conditioned on its count), at least `min_gap` apart, each on a uniformly drawn node slot.
4. Of them, `silent` (a fraction) come without a notice; of the noticed ones, `rebalance` (a fraction)
   are preceded by a rebalance recommendation 1-5 minutes ahead; `delayed` (a fraction) find no
   replacement capacity for 1-10 minutes. An `outage` removes every node at once for a while.
Deterministic: the same arguments and seed give the same trace, byte for byte. Pure: no I/O.
"""

from __future__ import annotations

import math
import random

from petctl.core.errors import ValidationError
from petctl.core.spottrace import NOTICE_GRACE, Trace, TraceEvent

BANDS: dict[str, float] = {"<5%": 0.025, "5-10%": 0.075, "10-15%": 0.125, "15-20%": 0.175, ">20%": 0.25}
HOURS_PER_MONTH = 730.0


def band_rate(band: str) -> float:
    """Unscaled losses per node-hour for a band (assumption 1). Raises ValidationError for an unknown one."""
    if band not in BANDS:
        raise ValidationError(f"unknown interruption band {band!r}: choose one of {', '.join(BANDS)}")
    return -math.log(1.0 - BANDS[band]) / HOURS_PER_MONTH


SCALE = 1.0 / band_rate("10-15%")  # assumption 2: the 10-15 % band at 1 loss per node-hour


def generate(name: str, band: str, *, nodes: int = 8, hours: float = 1.0, seed: int = 0,
             time_scale: float = 10.0, silent: float = 0.0, rebalance: float = 0.25, delayed: float = 0.25,
             outage: tuple[float, float] | None = None, min_gap: float = 120.0) -> Trace:
    """A trace of `hours` simulated hours for `nodes` nodes (see the module for the assumptions).

    outage: (start, duration) in simulated seconds, or None. Raises ValidationError for impossible input
    (more losses than fit `min_gap` apart, an unknown band).
    """
    rate = band_rate(band) * SCALE
    duration = hours * 3600.0
    count = max(1, round(rate * nodes * hours))
    if count * min_gap >= duration * 0.8:
        raise ValidationError(f"{count} losses do not fit {min_gap:.0f}s apart in {duration:.0f}s")
    rng = random.Random(f"{name}/{band}/{seed}")
    times = _spaced(rng, count, min_gap, duration - NOTICE_GRACE * 2, outage)
    n_silent = round(silent * count)
    silent_idx = set(rng.sample(range(count), n_silent))
    events: list[TraceEvent] = []
    for i, at in enumerate(times):
        node = rng.randrange(nodes)
        back = rng.uniform(60.0, 600.0) if rng.random() < delayed else 0.0
        if i in silent_idx:
            events.append(TraceEvent(at=round(at, 1), kind="loss", node=node, return_after=round(back, 1)))
        elif rng.random() < rebalance:
            lead = rng.uniform(60.0, 300.0)
            events.append(TraceEvent(at=round(max(0.0, at - lead - NOTICE_GRACE), 1), kind="rebalance",
                                     node=node, grace=round(lead, 1), return_after=round(back, 1)))
        else:
            events.append(TraceEvent(at=round(max(0.0, at - NOTICE_GRACE), 1), kind="notice", node=node,
                                     grace=NOTICE_GRACE, return_after=round(back, 1)))
    if outage is not None:
        events.append(TraceEvent(at=outage[0], kind="outage", grace=NOTICE_GRACE, duration=outage[1]))
    derivation = (
        f"Spot Instance Advisor band {band} (reclaimed capacity in the trailing month) taken at its midpoint "
        f"{BANDS[band]:.1%}/month as a constant hazard ({band_rate(band):.2e} per node-hour); ASSUMPTION: "
        f"scaled x{SCALE:.0f} (10-15% -> 1 loss per node-hour) to {rate:.2f} per node-hour; {count} losses "
        f"spread uniformly (seed {seed}), >= {min_gap:.0f}s apart; {n_silent} without notice; notices "
        f"{NOTICE_GRACE:.0f}s ahead; some preceded by a rebalance recommendation, some with replacement "
        f"capacity delayed 1-10 min" + (f"; an outage of every node at {outage[0]:.0f}s for {outage[1]:.0f}s"
                                        if outage else "")
        + f". Replayed {time_scale:g}x faster than simulated time. Generated by petctl.core.tracegen.")
    trace = Trace(name=name, nodes=nodes, duration=duration, time_scale=time_scale, seed=seed, band=band,
                  rate_per_node_hour=round(rate, 4), derivation=derivation,
                  events=tuple(sorted(events, key=lambda e: e.at)))
    trace.validate(name)
    return trace


def _spaced(rng: random.Random, count: int, gap: float, end: float,
            outage: tuple[float, float] | None) -> list[float]:
    """`count` reclaim times, `gap` apart and clear of the outage window: uniform order statistics on the
    free time less the gaps, then the gaps added back (exact, no rejection; deterministic per state)."""
    start = gap + NOTICE_GRACE + 300.0  # the job trains undisturbed first
    free = [(start, end)]
    if outage is not None:
        cut_lo, cut_hi = outage[0] - gap, outage[0] + outage[1] + NOTICE_GRACE + 2 * gap
        free = [(a, b) for a, b in ((start, min(end, cut_lo)), (max(start, cut_hi), end)) if b > a]
    total = sum(b - a for a, b in free)
    slack = total - (count - 1) * gap
    if slack <= 0:
        raise ValidationError(f"could not place {count} losses {gap:.0f}s apart (shorten the gap)")
    out = []
    for i, u in enumerate(sorted(rng.uniform(0.0, slack) for _ in range(count))):
        x = u + i * gap  # in free-time coordinates
        for a, b in free:
            if x <= b - a:
                out.append(a + x)
                break
            x -= b - a
    return out
