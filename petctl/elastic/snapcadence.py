"""How often to snapshot: every step unless that costs the training thread more than its budget.

The cost of one snapshot is what the training thread pays for it: its own CPU time for the layout and the
skeleton, plus any wall time it waited (for the previous snapshot's commit, or in the optimizer's pre-hook
for the background copy). CPU time rather than wall time for the work, so a loaded machine's scheduling
delays do not pass for the snapshot's cost; wall time for the waits, because then the step really stalls.

K (snapshot every K steps) >= median cost / (budget * median step time), over the last WINDOW samples so
one outlier moves nothing; raised at once, lowered only when half of K would do (no flapping). A snapshot
whose median cost is under FREE (1 ms: 1 % of the 100 ms step the goal is set on, and below the jitter of
a step on a loaded machine) is taken every step whatever the step time: a small state's fixed cost
(walking the state dict, about 0.3 ms here) must not cost a step of work on a loss. A fixed `every` turns
the choice off. Pure bookkeeping: no torch, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 9
SETTLE = 5  # samples before K may change (the first snapshots pay one-time costs: imports, page faults)
FREE = 0.001
MAX_EVERY = 1000


@dataclass
class Cadence:
    fixed: int | None = None  # a user's `every`; None: chosen
    budget: float = 0.01
    every: int = 1
    due: int = 1  # step ends until the next snapshot
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    costs: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _last_end: float | None = None

    def __post_init__(self) -> None:
        self.every = self.fixed or 1

    def step_ended(self, now: float) -> bool:
        """A step ended at `now` (monotonic seconds): True when a snapshot is due."""
        if self._last_end is not None:
            self.intervals.append(now - self._last_end)
        self._last_end = now
        self.due -= 1
        return self.due <= 0

    def started(self) -> None:
        self.due = self.every

    def record(self, cost: float) -> tuple[int, int, float, float] | None:
        """Add one snapshot's cost; (new K, old K, median cost, median step) when K changes, else None."""
        self.costs.append(cost)
        if self.fixed is not None or not self.intervals or len(self.costs) < SETTLE:
            return None
        cost_m, step_m = statistics.median(self.costs), statistics.median(self.intervals)
        need = 1
        if cost_m > FREE and step_m > 0:
            need = min(MAX_EVERY, max(1, math.ceil(cost_m / (self.budget * step_m))))
        if need > self.every or need <= self.every // 2:
            old, self.every = self.every, need
            self.due = min(self.due, need)
            return need, old, cost_m, step_m
        return None

    def step_time(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None
