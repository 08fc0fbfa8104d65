"""Turn the event lines of a run into figures: recovery time, steps lost, and a phase breakdown.

Every node's log holds the agent's events (petctl) and the workers' lines (both systems), all parsed with
`petctl.core.eventlog.parse_line`. A recovery is a sequence of milestones after the disruption at `t_event`;
each milestone is the moment the *last* node that must reach it did (the job is only as fast as its
slowest node), except detection, which is the first node to notice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.procs import Node

# (label, event names, aggregate over nodes). Worker-side milestones exist for torchrun too.
DETECT_EVENTS = ("preemption.notice", "membership.lost", "membership.waiting", "rendezvous.restart",
                 "torchrun.detect")
MILESTONES: list[tuple[str, tuple[str, ...], str]] = [
    ("detect", DETECT_EVENTS, "min"),
    ("workers_stopped", ("workers.stopped", "torchrun.rendezvous_start"), "max"),
    ("rendezvous", ("rendezvous.complete",), "max"),
    ("workers_started", ("workers.started", "worker.proc_start"), "max"),
    ("torch_imported", ("worker.imported",), "max"),
    ("process_group", ("worker.pg_ready",), "max"),
    ("model_ready", ("worker.setup",), "max"),
    ("elastic_imported", ("elastic.imported",), "max"),
    ("checkpointer_ready", ("elastic.comm_ready",), "max"),
    ("checkpoint_loaded", ("checkpoint.resumed", "train.resume"), "max"),
    ("first_step", ("train.step",), "max"),
]
LABELS = [label for label, _names, _agg in MILESTONES]
# A petctl survivor has learnt that a member is gone: it declared the loss itself, or joined the next round
# another survivor opened for it (issue 16's detection: every survivor knows).
KNOWN_EVENTS = ("membership.lost", "rendezvous.restart", "rendezvous.joined")
# petctl.elastic's `checkpoint.resumed` carries the worker's own start-up moments as fields (a user's
# script prints none of its own): field -> the event it stands for.
RESUMED_FIELDS = {"worker_started": "worker.proc_start", "elastic_imported": "elastic.imported",
                  "comm_ready": "elastic.comm_ready"}
# The five phases, and which measured milestones each one spans.
PHASES = {
    "detect": ["detect"],
    "rendezvous": ["workers_stopped", "rendezvous"],
    "workers_started": ["workers_started", "torch_imported", "process_group", "model_ready",
                        "elastic_imported", "checkpointer_ready"],
    "checkpoint_loaded": ["checkpoint_loaded"],
    "first_step": ["first_step"],
}


def expand(events: list[dict[str, Any]], after: float) -> list[dict[str, Any]]:
    """The events at or after `after`, plus the start-up moments some events carry as fields: a
    `worker.imported`'s process start (ts - seconds) and `checkpoint.resumed`'s timeline fields, each
    as an event of its own (same rank and world size)."""
    out = []
    for e in events:
        if e["event"] == "worker.imported" and "seconds" in e:  # the worker process's own start time
            out.append({**e, "event": "worker.proc_start", "ts": float(e["ts"]) - float(e["seconds"])})
        elif e["event"] == "checkpoint.resumed":
            # A moment before the worker started (petctl.elastic preloaded by a warm worker) is reached
            # when it starts: that phase cost this recovery nothing.
            floor = e.get("worker_started") if isinstance(e.get("worker_started"), (int, float)) else 0.0
            out.extend({**e, "event": name, "ts": max(float(e[key]), float(floor))}
                       for key, name in RESUMED_FIELDS.items() if isinstance(e.get(key), (int, float)))
        out.append(e)
    return [e for e in out if float(e["ts"]) >= after]


def _events(node: Node, after: float) -> list[dict[str, Any]]:
    return expand(node.events(), after)


def first_step_at(node: Node, world: int, after: float) -> float | None:
    for e in node.events("train.step", after=after):
        if int(e.get("world_size", 0)) == world:
            return float(e["ts"])
    return None


def recovered_at(nodes: list[Node], world: int, after: float) -> float | None:
    """When every node in `nodes` ran a step at `world` after `after` (None if one has not yet)."""
    times = [first_step_at(n, world, after) for n in nodes]
    return None if any(t is None for t in times) else max(times)  # type: ignore[type-var]


def all_know(nodes: list[Node], after: float) -> float | None:
    """Seconds after `after` when the last of `nodes` knew of the loss (its first KNOWN_EVENTS event);
    None while one has not (or for torchrun, whose agents print none of them)."""
    firsts = []
    for node in nodes:
        hits = [float(e["ts"]) for e in node.events(after=after) if e["event"] in KNOWN_EVENTS]
        if not hits:
            return None
        firsts.append(min(hits))
    return round(max(firsts) - after, 4)


def steps_lost(nodes: list[Node], world: int, after: float) -> int | None:
    """(last step executed before the resumed run started) - (step resumed from) + 1, floored at 0."""
    resumes = [e for n in nodes for e in n.events("train.resume", after=after)
               if int(e.get("world_size", 0)) == world]
    # The framework workloads (hf, lightning) print no train.resume: their callback's checkpoint.resumed
    # names the completed steps kept, and their train.step counts completed steps (1-based).
    counted = 0 if resumes else 1
    resumes = resumes or [e for n in nodes for e in n.events("checkpoint.resumed", after=after)
                          if int(e.get("world_size", 0)) == world]
    if not resumes:
        return None
    resumed = min(resumes, key=lambda e: float(e["ts"]))
    last = [int(e["step"]) for n in nodes for e in n.events("train.step")
            if float(e["ts"]) < float(resumed["ts"])]
    if not last:
        return None
    return max(0, max(last) - int(resumed["step"]) + 1 - counted)


def stall(nodes: list[Node], world: int, after: float) -> float | None:
    """The old members' pause: per node, from its last step before its first step at `world` (after
    `after`) to that first step; the longest over `nodes`. None while a node has not stepped at `world`."""
    gaps = []
    for node in nodes:
        first = first_step_at(node, world, after)
        if first is None:
            return None
        before = [float(e["ts"]) for e in node.events("train.step") if float(e["ts"]) < first]
        if before:
            gaps.append(first - max(before))
    return round(max(gaps), 4) if gaps else None


def milestones(nodes: list[Node], world: int, t_event: float,
               detect_nodes: list[Node] | None = None) -> dict[str, float]:
    """Seconds after `t_event` at which each milestone was reached (missing ones are left out)."""
    out: dict[str, float] = {}
    for label, names, agg in MILESTONES:
        pool = detect_nodes if (label == "detect" and detect_nodes) else nodes
        times: list[float] = []
        for node in pool:
            hits = [e for e in _events(node, t_event) if e["event"] in names]
            if label == "first_step":
                hits = [e for e in hits if int(e.get("world_size", 0)) == world]
            elif label != "detect" and label != "workers_stopped":
                # Milestones of the new round: reached at the new world size (events that carry one).
                hits = [e for e in hits if int(e.get("world_size", world) or world) == world]
            if hits:
                times.append(min(float(e["ts"]) for e in hits))
        if times and (agg == "min" or len(times) == len(pool)):
            out[label] = round((min(times) if agg == "min" else max(times)) - t_event, 4)
    # Keep the sequence monotonic: a milestone reached before the previous one carries no phase.
    return out


def phase_durations(marks: dict[str, float]) -> dict[str, float]:
    """The issue's five phases: each one's length, from the previous reached milestone to its last."""
    out: dict[str, float] = {}
    prev = 0.0
    for phase, labels in PHASES.items():
        reached = [marks[label] for label in labels if label in marks]
        if not reached:
            continue
        end = max(reached)
        out[phase] = round(max(0.0, end - prev), 4)
        prev = max(prev, end)
    return out


def sub_phases(marks: dict[str, float]) -> dict[str, float]:
    """Every measured milestone's own delta (finer than the five phases: shows what inside is slow)."""
    out: dict[str, float] = {}
    prev = 0.0
    for label, _names, _agg in MILESTONES:
        if label in marks:
            out[label] = round(max(0.0, marks[label] - prev), 4)
            prev = max(prev, marks[label])
    return out


@dataclass
class Summary:
    values: list[float]

    def as_dict(self) -> dict[str, float | int | None]:
        vals = sorted(v for v in self.values if v is not None)
        if not vals:
            return {"n": 0, "min": None, "median": None, "p90": None, "max": None}
        mid = len(vals) // 2
        median = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
        # p90: nearest rank (the smallest value with at least 90 % of the runs at or below it)
        p90 = vals[min(len(vals) - 1, -(-9 * len(vals) // 10) - 1)]
        return {"n": len(vals), "min": round(vals[0], 4), "median": round(median, 4),
                "p90": round(p90, 4), "max": round(vals[-1], 4)}


def summarize(values: list[float | None]) -> dict[str, float | int | None]:
    return Summary([v for v in values if v is not None]).as_dict()
