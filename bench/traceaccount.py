"""Goodput, steps lost, re-forming time and cost of one trace replay, from its timeline. Pure.

Inputs: rank 0's `train.step` lines (ts, step, world_size) from every node that ever ran rank 0, and each
instance's billed life (launch -> gone). Definitions:
- kept steps: for every step number, its last execution (earlier executions were redone: steps lost);
- kept training time: sum over kept executions of world_size x T, T the median time between two steps
  of one round (a step's useful work; a checkpoint stall or a re-form inside a gap is not useful);
- instance time: sum of every instance's billed life (launch, boot included, to reclaim), clipped to the
  replay window [start, end];
- goodput = kept training time / instance time, in that window (`measured`);
- re-forming: time in the window with no step for more than 3 T.

Simulated time. The trace is replayed `S` (time_scale) times faster than it was drawn, so the gaps between
losses are S times too short, while each loss costs what it really costs. The simulated figure keeps
every loss's waste and stretches the rest: with f the overhead of undisturbed training, waste
E = (instance - kept) - f x instance is what the events cost, and goodput_sim = 1 - f - E / (S x instance).
f comes from every undisturbed stretch of the run (`steady_overhead`): runs of at least MIN_STRETCH
consecutive steps of one round with no gap over 3 T, where f = 1 - (steps x T) / (the stretch's time), so
the checkpoint stalls and slow steps of steady training count, and one noisy window does not decide it
(it used to come from the window before the first event alone: 0.56 on a loaded machine). A round's
first SETTLE_S seconds are not steady training: they belong to the event that formed the round. On the
bench machine the steps of those seconds ran slower (2026-11-27, spot-10-15-mixed: petctl's averaged
0.32 s in a round's first 5 s, 0.22 in the next 5 and 0.20 from 10 s on; torchrun's 0.20 throughout),
likely the warm pools' refill, which starts at a round's first step: a torch import per node, 8 nodes on
2 cores. Counted into f, that transient would be stretched by S with the undisturbed time, as if it
recurred all along; it recurs once per event, so it stays in E, which the simulation keeps once per event.
The instance time is dominated by the gaps, so S x instance
is the simulated instance time (within the boot and notice windows that do not stretch).
Boot time B (launch -> agent start) enters as n_launches x (B - B_replayed) more billed, idle instance
time: the world trains at N-1 meanwhile, so nothing else changes to first order. That is how the
figures at an AWS-like 90 s and 180 s boot are computed without waiting for them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Life:
    launched: float
    ended: float


@dataclass(frozen=True)
class Outcome:
    steps_run: int
    steps_kept: int
    steps_lost: int
    step_time_s: float
    kept_node_s: float
    instance_node_s: float
    reforming_s: float
    steady_overhead: float
    goodput_measured: float
    goodput_sim: dict[str, float]  # boot label -> simulated goodput
    instance_hours_sim: dict[str, float]  # boot label -> simulated instance-hours
    kept_node_hours_sim: float


MIN_STRETCH = 10  # steps: a shorter run between two disruptions says little about steady training
SETTLE_S = 10.0  # seconds from a round's first step that belong to the event that formed it (see above)


def steady_overhead(rows: list[tuple[float, int, int, str, Any]], t: float,
                    settle: float = SETTLE_S) -> float:
    """f: 1 - (steps x T) / time, over every undisturbed stretch in `rows` (ts, step, world, node, round,
    sorted by ts): consecutive steps on one node in one round with no gap over 3 T, MIN_STRETCH steps at
    least, from `settle` seconds after that round's first step on. 0.0 when there is no such stretch or T
    is 0."""
    if t <= 0:
        return 0.0
    useful = elapsed = 0.0
    by_run: dict[tuple[str, Any], list[tuple[float, int]]] = {}
    for ts, step, _w, node, rnd in rows:
        by_run.setdefault((node, rnd), []).append((ts, step))
    for whole in by_run.values():
        run = [row for row in whole if row[0] - whole[0][0] >= settle]
        if not run:
            continue
        stretch = [run[0]]
        for prev, cur in zip(run, run[1:], strict=False):
            if cur[1] == prev[1] + 1 and cur[0] - prev[0] <= 3 * t:
                stretch.append(cur)
                continue
            useful, elapsed = _add(stretch, t, useful, elapsed)
            stretch = [cur]
        useful, elapsed = _add(stretch, t, useful, elapsed)
    return max(0.0, 1.0 - useful / elapsed) if elapsed > 0 else 0.0


def _add(stretch: list[tuple[float, int]], t: float, useful: float, elapsed: float) -> tuple[float, float]:
    if len(stretch) < MIN_STRETCH:
        return useful, elapsed
    return useful + (len(stretch) - 1) * t, elapsed + stretch[-1][0] - stretch[0][0]


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def account(steps: Iterable[dict[str, Any]], lives: Iterable[Life], start: float, end: float,
            time_scale: float, launches: int, boot_replayed: float,
            boots: dict[str, float], settle: float = SETTLE_S) -> Outcome:
    """See the module. `steps`: rank 0's train.step records (any order); times are unix seconds."""
    rows = sorted((float(r["ts"]), int(r["step"]), int(r.get("world_size", 1)), str(r.get("node", "")),
                   r.get("restart", r.get("round", ""))) for r in steps)
    last: dict[int, tuple[float, int]] = {}
    for ts, step, world, _node, _round in rows:
        last[step] = (ts, world)
    gaps = [b[0] - a[0] for a, b in zip(rows, rows[1:], strict=False)
            if a[3] == b[3] and a[4] == b[4] and b[1] == a[1] + 1]
    t = statistics.median(gaps) if gaps else 0.0
    in_window = [r for r in rows if start <= r[0] <= end]
    kept = [(ts, w) for ts, w in last.values() if start <= ts <= end]
    kept_node_s = sum(w for _, w in kept) * t
    lives = list(lives)
    inst = sum(_clip(x.launched, x.ended, start, end) for x in lives)
    f = steady_overhead(in_window, t, settle)
    reform = 0.0
    times = [r[0] for r in in_window]
    for a, b in zip([start, *times], [*times, end], strict=False):
        if t and b - a > 3 * t:
            reform += b - a
    measured = kept_node_s / inst if inst else 0.0
    events_waste = max(0.0, (inst - kept_node_s) - f * inst)
    sim_inst = time_scale * inst
    goodput_sim, hours_sim = {}, {}
    for label, boot in boots.items():
        extra = launches * max(0.0, boot - boot_replayed)
        goodput_sim[label] = round(1.0 - f - (events_waste + extra) / (sim_inst + extra), 4) if inst else 0.0
        hours_sim[label] = round((sim_inst + extra) / 3600.0, 3)
    kept_sim_h = (sim_inst * (1.0 - f) - events_waste) / 3600.0
    steps_kept = len(kept)
    return Outcome(steps_run=len(in_window), steps_kept=steps_kept,
                   steps_lost=max(0, len(in_window) - steps_kept), step_time_s=round(t, 4),
                   kept_node_s=round(kept_node_s, 1), instance_node_s=round(inst, 1),
                   reforming_s=round(reform, 2),
                   steady_overhead=round(f, 4), goodput_measured=round(measured, 4), goodput_sim=goodput_sim,
                   instance_hours_sim=hours_sim, kept_node_hours_sim=round(max(0.0, kept_sim_h), 3))


def cost(outcome: Outcome, spot: float, on_demand: float) -> dict[str, dict[str, float]]:
    """Per boot label: the spot bill of the simulated run, the same instance-hours on demand, and what the
    kept training would cost on demand (on-demand capacity is not reclaimed: no waste but the steady
    overhead), with the saving against the latter (SageMaker's 1 - billable / total, per unit of work)."""
    out = {}
    for label, hours in outcome.instance_hours_sim.items():
        bill = hours * spot
        od_same = hours * on_demand
        od_work = outcome.kept_node_hours_sim / max(1e-9, 1.0 - outcome.steady_overhead) * on_demand
        out[label] = {"spot_usd": round(bill, 2), "on_demand_same_hours_usd": round(od_same, 2),
                      "on_demand_same_work_usd": round(od_work, 2),
                      "saving_vs_on_demand": round(1.0 - bill / od_work, 3) if od_work else 0.0}
    return out
