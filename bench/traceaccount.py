"""Goodput, steps lost, re-forms and billed time of one trace replay, from its timeline. Pure.

Inputs, as typed records:
- `Step`: rank 0's `train.step` lines (ts, step, world size, node, round) from every node that ever ran
  rank 0;
- `Life`: each instance's billed life, from the fleet's instance events (`lives_from_events`:
  `instance.launched` to `instance.reclaimed` / `instance.terminated` / `instance.lost`; an instance
  with no end is billed to the end of the replay). The node's own agent events are not used: an
  instance is billed while it boots, after its agent left, and until it is gone.

Two figures, both over every billed second in the window [start, end]:

    goodput_measured = K / B
    goodput_scaled   = S*K / (S*(B - F) + F)  =  K / (B - F*(1 - 1/S))

- B, billed node-seconds: the sum of every instance's life (launch, boot included, to its end),
  clipped to the window.
- K, kept node-seconds: for every step number its last execution, world size x T (T: the median time
  between two steps of one round).
- F, the events' fixed costs, in node-seconds. They take as long in a real hour as in the replay:
  - re-form stalls: between two consecutive rank-0 steps of different rounds, or of one round more
    than 3 T apart (a save stall), (gap - T) x the world size of the step after the gap;
  - lost steps: every execution of a step that was executed again later, world size x T;
  - the settle transient: in the first SETTLE_S seconds of a round formed in the window, the steps'
    time over T (summed, at least 0), x world size (the warm pools refill once per event; see below).
- Everything else, B - K - F, is a duration the replay compressed by S (time_scale): a booting
  instance (the boot is replayed as boot / S), a noticed node billed after it left the world until it
  ends, a node waiting to be admitted, and the steady overhead (checkpoint stalls and slow steps of
  undisturbed training). So are the training stretches that give K.

`goodput_measured` is the replay as run: a re-form or a save does not shrink with S, so it weighs S
times too much there (a conservative figure). `goodput_scaled` brings the run to real time: every
compressed duration stretches by S (K and B - K - F), each event's fixed cost stays once (F):
billed' = S*(B - F) + F and kept' = S*K. With S = 1 the two figures agree.

Worked example (tests/bench/test_traceaccount.py builds it step by step): S = 10, T = 1 s, 3 nodes, a
100 s window. A notice whose replacement boots 9 s (a 90 s boot) and hands off with a 1 s stall (3 nodes),
the leaver billed 3 s after it left; a silent loss with 2 steps redone (world 3) and a 3 s stall (world
2), its replacement booting 9 s and joining with a 1 s stall (3 nodes). B = 312, K = 273,
F = 3 + 6 + 3 (stalls) + 6 (lost) = 18, the compressed rest 21 (the first boot 9, the second 9 plus
0.5 waiting for the round, the leaver's 3, -0.5 for the node lost mid-step). measured = 273 / 312 =
0.875; scaled = 2730 / (10 x 294 + 18) = 2730 / 2958 = 0.9229. The formula before issue 43 kept
all of B - K as the events' waste and stretched only the rest: 1 - 39 / 3120 = 0.9875, with the boots
and the notice window billed at a tenth.

A round's first SETTLE_S seconds. On the bench machine the steps of those seconds ran slower
(2026-11-27, spot-10-15-mixed: petctl's averaged 0.32 s in a round's first 5 s, 0.22 in the next 5 and
0.20 from 10 s on; torchrun's 0.20 throughout), likely the warm pools' refill, which starts at a round's
first step: a torch import per node, 8 nodes on 2 cores. It recurs once per event, so it is a fixed
cost, not stretched with the undisturbed time.

Limits: a stall is taken as fixed. In an outage (every node gone until capacity returns) the job's
stall is a wait for capacity, which the replay compressed; this accounting would count it once. The
shipped notice and mixed traces have no outage.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MIN_STRETCH = 10  # steps: a shorter run between two disruptions says little about steady training
SETTLE_S = 10.0  # seconds from a round's first step that belong to the event that formed it (see above)
END_EVENTS = ("instance.reclaimed", "instance.terminated", "instance.lost")


@dataclass(frozen=True)
class Step:
    """One rank-0 step: when it ended (unix s), its number, the world it ran in, and its round."""

    ts: float
    step: int
    world: int
    node: str = ""
    round: Any = ""


@dataclass(frozen=True)
class Life:
    """One instance's billed life: from its launch to its end (unix s); `booted` when its node started."""

    launched: float
    ended: float
    booted: float | None = None
    name: str = ""


@dataclass(frozen=True)
class Outcome:
    steps_run: int
    steps_kept: int
    steps_lost: int
    reforms: int  # rounds formed after the first in the window
    step_time_s: float
    billed_node_s: float  # B
    kept_node_s: float  # K
    reform_node_s: float  # F: the stalls
    lost_node_s: float  # F: the redone steps
    settle_node_s: float  # F: the settle transients
    compressed_node_s: float  # B - K - F: boots, idle after a leave, waits, steady overhead
    reforming_s: float  # seconds in the window with no step for more than 3 T
    steady_overhead: float  # informative: 1 - useful / elapsed over undisturbed stretches
    time_scale: float
    goodput_measured: float
    goodput_scaled: float
    billed_node_h_scaled: float  # (S*(B - F) + F) / 3600
    kept_node_h_scaled: float  # S*K / 3600


def steps_from(records: Iterable[dict[str, Any]]) -> list[Step]:
    """`train.step` records (ts, step, world_size, node, restart or round) as Steps, in time order."""
    return sorted((Step(float(r["ts"]), int(r["step"]), int(r.get("world_size", 1)), str(r.get("node", "")),
                        r.get("restart", r.get("round", ""))) for r in records), key=lambda s: s.ts)


def lives_from_events(events: Iterable[dict[str, Any]], end: float) -> list[Life]:
    """Each instance's life from the fleet's (or the local reconciler's) instance events: launched at
    `instance.launched`, booted at `instance.booted`, ended at its first end event; no end: `end`."""
    launched: dict[str, float] = {}
    booted: dict[str, float] = {}
    ended: dict[str, float] = {}
    for e in sorted(events, key=lambda e: float(e["ts"])):
        name, ts, kind = str(e["instance"]), float(e["ts"]), e["event"]
        if kind == "instance.launched":
            launched.setdefault(name, ts)
        elif kind == "instance.booted":
            booted.setdefault(name, ts)
        elif kind in END_EVENTS:
            ended.setdefault(name, ts)
    return [Life(t, ended.get(name, end), booted.get(name), name) for name, t in launched.items()]


def goodput_scaled(kept_node_s: float, billed_node_s: float, fixed_node_s: float, time_scale: float) -> float:
    """S*K / (S*(B - F) + F): every compressed duration stretched by S, each fixed cost once."""
    s = time_scale
    rest = max(0.0, billed_node_s - fixed_node_s)
    billed = s * rest + fixed_node_s
    return s * kept_node_s / billed if billed > 0 else 0.0


def steady_overhead(rows: list[Step], t: float, settle: float = SETTLE_S) -> float:
    """f: 1 - (steps x T) / time, over every undisturbed stretch in `rows` (sorted by ts): consecutive
    steps on one node in one round with no gap over 3 T, MIN_STRETCH steps at least, from `settle`
    seconds after that round's first step on. 0.0 when there is no such stretch or T is 0."""
    if t <= 0:
        return 0.0
    useful = elapsed = 0.0
    for whole in _runs(rows).values():
        run = [row for row in whole if row.ts - whole[0].ts >= settle]
        if not run:
            continue
        stretch = [run[0]]
        for prev, cur in zip(run, run[1:], strict=False):
            if cur.step == prev.step + 1 and cur.ts - prev.ts <= 3 * t:
                stretch.append(cur)
                continue
            useful, elapsed = _add(stretch, t, useful, elapsed)
            stretch = [cur]
        useful, elapsed = _add(stretch, t, useful, elapsed)
    return max(0.0, 1.0 - useful / elapsed) if elapsed > 0 else 0.0


def _runs(rows: list[Step]) -> dict[tuple[str, Any], list[Step]]:
    by_run: dict[tuple[str, Any], list[Step]] = {}
    for r in rows:
        by_run.setdefault((r.node, r.round), []).append(r)
    return by_run


def _add(stretch: list[Step], t: float, useful: float, elapsed: float) -> tuple[float, float]:
    if len(stretch) < MIN_STRETCH:
        return useful, elapsed
    return useful + (len(stretch) - 1) * t, elapsed + stretch[-1].ts - stretch[0].ts


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def account(steps: Iterable[Step], lives: Iterable[Life], start: float, end: float, time_scale: float,
            settle: float = SETTLE_S) -> Outcome:
    """See the module. Times are unix seconds (or any one clock); `steps` in any order."""
    rows = sorted(steps, key=lambda r: r.ts)
    gaps = [b.ts - a.ts for a, b in zip(rows, rows[1:], strict=False)
            if (a.node, a.round) == (b.node, b.round) and b.step == a.step + 1]
    t = statistics.median(gaps) if gaps else 0.0
    win = [r for r in rows if start <= r.ts <= end]
    last: dict[int, Step] = {}
    for r in win:
        last[r.step] = r
    kept_node_s = sum(r.world for r in last.values()) * t
    lost_node_s = sum(r.world for r in win if last[r.step] is not r) * t
    billed = sum(_clip(x.launched, x.ended, start, end) for x in lives)
    reform_node_s = reforming = 0.0
    reforms = 0
    for a, b in zip(win, win[1:], strict=False):
        gap = b.ts - a.ts
        new_round = (a.node, a.round) != (b.node, b.round)
        reforms += new_round
        if new_round or gap > 3 * t:
            reform_node_s += max(0.0, gap - t) * b.world
    times = [r.ts for r in win]
    for a_ts, b_ts in zip([start, *times], [*times, end], strict=False):
        if t and b_ts - a_ts > 3 * t:
            reforming += b_ts - a_ts
    settle_node_s = 0.0
    before = {(r.node, r.round) for r in rows if r.ts < start}  # rounds formed before the window
    for key, run in _runs(win).items():
        if key in before:
            continue
        excess = sum(b.ts - a.ts - t for a, b in zip(run, run[1:], strict=False)
                     if b.step == a.step + 1 and b.ts - a.ts <= 3 * t and b.ts - run[0].ts <= settle + 1e-6)
        settle_node_s += max(0.0, excess) * run[0].world
    fixed = reform_node_s + lost_node_s + settle_node_s
    s = time_scale
    scaled = goodput_scaled(kept_node_s, billed, fixed, s)
    return Outcome(
        steps_run=len(win), steps_kept=len(last), steps_lost=len(win) - len(last), reforms=reforms,
        step_time_s=round(t, 4), billed_node_s=round(billed, 1), kept_node_s=round(kept_node_s, 1),
        reform_node_s=round(reform_node_s, 1), lost_node_s=round(lost_node_s, 1),
        settle_node_s=round(settle_node_s, 1), compressed_node_s=round(billed - kept_node_s - fixed, 1),
        reforming_s=round(reforming, 2), steady_overhead=round(steady_overhead(win, t, settle), 4),
        time_scale=s, goodput_measured=round(kept_node_s / billed, 4) if billed else 0.0,
        goodput_scaled=round(scaled, 4),
        billed_node_h_scaled=round((s * max(0.0, billed - fixed) + fixed) / 3600.0, 3),
        kept_node_h_scaled=round(s * kept_node_s / 3600.0, 3))


def cost(outcome: Outcome, spot: float, on_demand: float) -> dict[str, float]:
    """The spot bill of the run brought to real time, the same instance-hours on demand, and what the
    kept training would cost on demand (on-demand capacity is not reclaimed: no waste but the steady
    overhead), with the saving against the latter (SageMaker's 1 - billable / total, per unit of work)."""
    hours = outcome.billed_node_h_scaled
    bill = hours * spot
    od_work = outcome.kept_node_h_scaled / max(1e-9, 1.0 - outcome.steady_overhead) * on_demand
    return {"spot_usd": round(bill, 2), "on_demand_same_hours_usd": round(hours * on_demand, 2),
            "on_demand_same_work_usd": round(od_work, 2),
            "saving_vs_on_demand": round(1.0 - bill / od_work, 3) if od_work else 0.0}
