"""A spot trace: what the spot market does to a job, as a typed list of timed events, and its replay plan.

A trace is data (a JSON file, `Trace.from_json`) so that two systems replay exactly the same thing. Event
kinds, each at `at` simulated seconds from the start:

    notice     a spot interruption notice to one node; reclaimed `grace` seconds later (AWS: 120 s)
    loss       a node lost without a notice (a spot reclaim whose notice never came, a host failure)
    rebalance  a rebalance recommendation to one node, followed `grace` later by its notice (itself 120 s
               ahead of the reclaim): AWS sends the recommendation earlier than the notice, or with it
    outage     capacity gone entirely: every node gets a notice (`grace`) and none can be launched for
               `duration` seconds

A notice or a loss may carry `return_after`: capacity for the replacement comes back only that long
after the reclaim (the ASG's launches fail meanwhile). `node` is a slot (0..nodes-1) the replayer maps
onto a live node (the slot-th in launch order, modulo the live count), so the same trace picks the same
position under every system.

Time: a trace is written in simulated seconds; `time_scale` simulated seconds pass per replayed second
(`replay_at`). Gaps between events shrink; a notice's grace, a capacity delay and an outage shrink with
them. Boot time is not part of the trace: it is a replay parameter. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from petctl.core.errors import ValidationError

KINDS = ("notice", "loss", "rebalance", "outage")
FORMAT = 1
NOTICE_GRACE = 120.0  # AWS: the interruption notice comes two minutes ahead


@dataclass(frozen=True)
class TraceEvent:
    at: float  # simulated seconds from the trace's start
    kind: str  # one of KINDS
    node: int = 0  # slot, mapped onto a live node by the replayer (ignored by an outage)
    grace: float = 120.0  # notice/rebalance/outage: seconds from the notice to the reclaim
    return_after: float = 0.0  # capacity for the replacement returns this long after the reclaim
    duration: float = 0.0  # outage: seconds with no capacity at all

    def reclaim_at(self) -> float:
        """When the node (or, for an outage, every node) is gone, in simulated seconds."""
        if self.kind == "rebalance":
            return self.at + self.grace + NOTICE_GRACE
        return self.at if self.kind == "loss" else self.at + self.grace

    def capacity_back_at(self) -> float:
        """When a replacement can be launched again, in simulated seconds."""
        return self.reclaim_at() + (self.duration if self.kind == "outage" else self.return_after)


@dataclass(frozen=True)
class Trace:
    name: str
    nodes: int  # the job's size the trace was drawn for
    duration: float  # simulated seconds
    time_scale: float = 1.0  # simulated seconds per replayed second
    seed: int | None = None
    band: str = ""  # the Spot Instance Advisor band it was derived from, if any
    rate_per_node_hour: float | None = None  # the interruption rate it was drawn at (scaled)
    derivation: str = ""  # how it was made, and which parts are assumptions
    events: tuple[TraceEvent, ...] = field(default_factory=tuple)

    # --- codec -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        doc = {"format": FORMAT, **asdict(self)}
        doc["events"] = [asdict(e) for e in self.events]
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "trace") -> Trace:
        """Parse and validate. Raises ValidationError with one line naming what is wrong."""
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ValidationError(f"{source}: not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ValidationError(f"{source}: expected a JSON object with 'events', got {type(doc).__name__}")
        if doc.get("format", FORMAT) != FORMAT:
            raise ValidationError(f"{source}: format {doc.get('format')!r} is not supported (want {FORMAT})")
        raw = doc.get("events")
        if not isinstance(raw, list):
            raise ValidationError(f"{source}: 'events' must be a list")
        events = tuple(_event(e, i, source) for i, e in enumerate(raw))
        try:
            trace = cls(name=str(doc.get("name", source)), nodes=int(doc["nodes"]),
                        duration=float(doc["duration"]), time_scale=float(doc.get("time_scale", 1.0)),
                        seed=None if doc.get("seed") is None else int(doc["seed"]),
                        band=str(doc.get("band", "")),
                        rate_per_node_hour=(None if doc.get("rate_per_node_hour") is None
                                            else float(doc["rate_per_node_hour"])),
                        derivation=str(doc.get("derivation", "")), events=events)
        except KeyError as e:
            raise ValidationError(f"{source}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValidationError(f"{source}: bad field value ({e})") from None
        trace.validate(source)
        return trace

    def validate(self, source: str = "trace") -> None:
        if self.nodes < 1:
            raise ValidationError(f"{source}: nodes must be >= 1 (got {self.nodes})")
        if self.duration <= 0 or self.time_scale <= 0:
            raise ValidationError(f"{source}: duration and time_scale must be > 0")
        last = -1.0
        for i, e in enumerate(self.events):
            if e.at < last:
                raise ValidationError(f"{source}: event {i} at {e.at}s comes before the one at {last}s "
                                      "(events must be in time order)")
            if e.at > self.duration:
                raise ValidationError(f"{source}: event {i} at {e.at}s is after the trace's end "
                                      f"({self.duration}s)")
            last = e.at

    # --- what it amounts to ----------------------------------------------------------------------
    def replay_seconds(self) -> float:
        return self.duration / self.time_scale

    def counts(self) -> dict[str, int]:
        return {k: sum(1 for e in self.events if e.kind == k) for k in KINDS}

    def losses(self) -> int:
        """Nodes taken away (an outage takes all of them)."""
        return sum(self.nodes if e.kind == "outage" else 1 for e in self.events)

    def rate(self) -> float:
        """Node losses per node-hour of simulated time."""
        return self.losses() / (self.nodes * self.duration / 3600.0)


def _event(raw: Any, i: int, source: str) -> TraceEvent:
    if not isinstance(raw, dict):
        raise ValidationError(f"{source}: event {i} must be an object")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ValidationError(f"{source}: event {i} has kind {kind!r}; choose one of {', '.join(KINDS)}")
    unknown = set(raw) - {"at", "kind", "node", "grace", "return_after", "duration"}
    if unknown:
        raise ValidationError(f"{source}: event {i} has unknown fields {sorted(unknown)}")
    try:
        event = TraceEvent(at=float(raw["at"]), kind=kind, node=int(raw.get("node", 0)),
                           grace=float(raw.get("grace", 120.0)),
                           return_after=float(raw.get("return_after", 0.0)),
                           duration=float(raw.get("duration", 0.0)))
    except KeyError:
        raise ValidationError(f"{source}: event {i} has no 'at'") from None
    except (TypeError, ValueError) as e:
        raise ValidationError(f"{source}: event {i}: {e}") from None
    if event.at < 0 or event.grace < 0 or event.return_after < 0 or event.duration < 0 or event.node < 0:
        raise ValidationError(f"{source}: event {i}: times and node must be >= 0")
    if kind == "outage" and event.duration <= 0:
        raise ValidationError(f"{source}: event {i}: an outage needs a duration > 0")
    return event


# --- the replay plan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """One thing the replayer does, at `at` replay seconds from its start."""

    at: float
    what: str  # notice | rebalance | kill | hold (no launches until `until`)
    event: int  # index of the trace event it comes from
    node: int | None = None  # slot; None: every node (an outage)
    grace: float = 0.0  # replay seconds from the notice to the reclaim
    until: float = 0.0  # hold: replay seconds (from the start) when capacity returns


def plan(trace: Trace) -> list[Action]:
    """The trace as replay actions in replay seconds, in time order (stable for equal times).

    A notice is one action: the system under test enforces the reclaim itself (the local reconciler;
    the benchmark's replayer), `grace` later. A rebalance is a recommendation now and a notice to the
    same node `grace` later (same `event` index). A capacity delay or outage is a hold on launches,
    which starts at the notice (a replacement may not be launched before the reclaim anyway) and ends
    when capacity returns.
    """
    s = trace.time_scale
    out: list[Action] = []
    for i, e in enumerate(trace.events):
        at, grace = e.at / s, e.grace / s
        back = e.capacity_back_at() / s
        if e.kind == "outage":
            out.append(Action(at, "hold", i, None, until=back))
            out.append(Action(at, "notice", i, None, grace=grace))
            continue
        if back > e.reclaim_at() / s:
            out.append(Action(at, "hold", i, e.node, until=back))
        if e.kind == "loss":
            out.append(Action(at, "kill", i, e.node))
        elif e.kind == "notice":
            out.append(Action(at, "notice", i, e.node, grace=grace))
        else:  # the recommendation, then the notice to the same node (the replayer links them by `event`)
            out.append(Action(at, "rebalance", i, e.node, grace=grace))
            out.append(Action(at + grace, "notice", i, e.node, grace=NOTICE_GRACE / s))
    return sorted(out, key=lambda a: a.at)


def due(actions: list[Action], done: int, elapsed: float) -> tuple[list[Action], int]:
    """The actions whose time has come after `done` of them ran, `elapsed` replay seconds in."""
    end = done
    while end < len(actions) and actions[end].at <= elapsed:
        end += 1
    return actions[done:end], end


def pick_slot(slot: int, live: list[str]) -> str | None:
    """The live node (in launch order) a slot maps to; None when none is live."""
    return live[slot % len(live)] if live else None
