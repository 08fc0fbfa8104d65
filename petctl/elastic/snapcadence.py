"""How often to snapshot: every step unless that costs the training thread more than its budget.

The cost of one snapshot is what the training thread pays for it: its own CPU time for the layout and the
skeleton, plus any wall time it waited (for the previous snapshot's commit, or in the optimizer's pre-hook
for the background copy). CPU time rather than wall time for the work, so a loaded machine's scheduling
delays do not pass for the snapshot's cost; wall time for the waits, because then the step really stalls.

K (snapshot every K steps) >= median cost / (budget * median step time), over the last WINDOW samples so
one outlier moves nothing; raised at once, lowered only when half of K would do (no flapping). No
verdict on the cost before SETTLE samples (the first snapshots pay one-time costs), except for a GPU's
hold on the next optimizer step, timed by CUDA events (`snapdevice`): the smallest such cost so far may
raise K at once. A snapshot
whose median cost is under FREE (1 ms: 1 % of the 100 ms step the goal is set on, and below the jitter of
a step on a loaded machine) is taken every step whatever the step time: a small state's fixed cost
(walking the state dict, about 0.3 ms here) must not cost a step of work on a loss. A fixed `every` turns
the choice off.

K is also at least the background time of a snapshot (its bytes over the measured copy rate: for a GPU
state the device-to-host link, then the host copy and checksum) over the step time, from the first
snapshot on: a snapshot due while the previous one is still being written would wait for it (the writer
takes the next one at the first step end after it is done instead), so a K below that is one the writer
cannot keep, and a 16 GB state whose copy takes seconds gets its K before it has stalled anything.
Pure bookkeeping: no torch, no I/O.
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
    busy: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # background seconds
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

    def record(self, cost: float | None, busy: float | None = None,
               timed: bool = False) -> tuple[int, int, float, float] | None:
        """Add one snapshot's cost to the training thread (None: not a measured one, a first touch of
        the memory) and the seconds its background work took; (new K, old K, median cost, median step)
        when K changes, else None. `timed`: the cost includes a GPU hold timed on the device (then the
        smallest cost so far may raise K before SETTLE samples)."""
        if cost is not None:
            self.costs.append(cost)
        if busy is not None:
            self.busy.append(busy)
        if self.fixed is not None or not self.intervals:
            return None
        step_m = statistics.median(self.intervals)
        cost_m = statistics.median(self.costs) if self.costs else 0.0
        need = 1
        cost_k = cost_m if len(self.costs) >= SETTLE else 0.0
        if len(self.costs) < SETTLE and timed:
            # a GPU's hold timed by CUDA events carries no scheduling noise: K follows it at once, so a
            # 16 GB copy stalls one step, not SETTLE of them
            cost_k = min(self.costs)
        if cost_k > FREE and step_m > 0:
            need = math.ceil(cost_k / (self.budget * step_m))
        if self.busy and step_m > 0:
            need = max(need, math.ceil(statistics.median(self.busy) / step_m))
        need = min(MAX_EVERY, need)
        if len(self.costs) < SETTLE and need <= self.every:
            return None  # before the cost has settled, only the pipeline bound may raise K
        if need > self.every or need <= self.every // 2:
            old, self.every = self.every, need
            self.due = min(self.due, need)
            return need, old, cost_m, step_m
        return None

    def step_time(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None
