"""Goodput and lost work, computed from a job's event timeline (what the agents wrote).

Why from events: they are the one record that exists for both providers, survives the job (mirrored to
the job's prefix) and needs no extra instrumentation in the user's script beyond the step lines that
petctl.elastic (or the script) prints. Definitions, per round r (a rendezvous generation):

- resume(r+1) is the first step round r+1 ran (it resumed from the checkpoint before it);
- steps lost in r = last step run in r - resume(r+1) + 1 (>= 0): work done and thrown away;
- kept node-seconds in r = kept steps x mean step time in r x world size;
- re-forming = from the last step of a round that trained (the disruption: training stopped there) to
  the first step of the next one that did (training resumed): the stall users see (rounds that re-formed
  again before training fall inside it). A job that prints no step lines cannot say when training
  resumed: it is timed from what the agents saw themselves, from the end of a round (its first worker
  failure, the restart that replaced it, or its workers stopping, whichever came first) to the next
  round's workers starting, and shown as a lower bound (`reform_lower_bound`): the workers' start-up,
  imports and checkpoint loading before their first step are not in it (issue 25 measured 0.5 s against
  19 s without training);
- re-forms = rounds opened after the first, whatever the cause (a node lost or joining, a planned change,
  a worker failure); failure restarts = those opened after a worker failure, the ones `--max-restarts`
  bounds (the round record's `restarts`);
- goodput = kept node-seconds / instance node-seconds;
- instance node-seconds: every billed second, from the provider's launch of each instance to its
  termination or reclaim (`BilledSpan`: the local reconciler's instances.json; on AWS the instances'
  LaunchTime and the group's termination activities), so a boot and a notice window after the agent
  left are counted. Only an instance the provider has no record of (an older job, an AWS group already
  deleted) falls back to its agent's life, `agent.started` to its exit or last word; `billing_basis`
  says which: "provider", "agents" (the fallback), or "provider+agents" (some of each).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from petctl.jobview.prefix import merge


@dataclass
class RoundStats:
    round: int
    world_size: int
    started: float
    ended: float | None
    first_step: int | None
    last_step: int | None
    first_step_ts: float | None
    last_step_ts: float | None
    cause: str = ""
    steps_lost: int = 0
    kept_steps: int = 0
    kept_node_seconds: float = 0.0
    # No member wrote its summary (each was killed or lost with its instance): where it started and how
    # far it got come from its workers' loads and saves (`_unseen_span`), and its steps lost beyond the
    # last one known are unknown.
    unseen: bool = False


@dataclass(frozen=True)
class BilledSpan:
    """One instance as its provider bills it: launched at `launched_at`, ended (terminated, reclaimed)
    at `ended_at`, None while it runs. Type, market and zone when the provider knows them (pricing)."""

    instance: str
    launched_at: float
    ended_at: float | None = None
    instance_type: str = ""
    market: str = ""
    az: str = ""


@dataclass
class InstanceSpan:
    """One instance's billed time, and where the figure came from ("provider" or "agents")."""

    node: str
    start: float
    end: float
    basis: str
    identity: dict[str, Any]  # instance_type, market, az: the provider's, else the agent's start event


def instance_spans(events: Iterable[dict[str, Any]], billed: Iterable[BilledSpan] | None = None,
                   now: float | None = None) -> list[InstanceSpan]:
    """Every instance's billed span: the provider's record where it has one (launch to end; one still
    running counts to `now`, or, with no `now`, to its agent's last word), else its agent's life."""
    agents = node_spans(events, now)
    by_node: dict[str, list[NodeSpan]] = {}
    for span in agents:
        by_node.setdefault(span.node, []).append(span)
    out: list[InstanceSpan] = []
    recorded: set[str] = set()
    for b in billed or ():
        recorded.add(b.instance)
        mine = by_node.get(b.instance, [])
        end = b.ended_at if b.ended_at is not None else now if now is not None else \
            max((s.end for s in mine), default=b.launched_at)
        started = mine[0].start_event if mine else {}
        identity = {"instance_type": b.instance_type or started.get("instance_type", ""),
                    "market": b.market or started.get("market", ""), "az": b.az or started.get("az", "")}
        out.append(InstanceSpan(b.instance, b.launched_at, max(b.launched_at, end), "provider", identity))
    for span in agents:
        if span.node not in recorded:
            identity = {k: span.start_event.get(k, "") for k in ("instance_type", "market", "az")}
            out.append(InstanceSpan(span.node, span.start, span.end, "agents", identity))
    return out


def billing_basis(bases: Iterable[str]) -> str:
    """"provider", "agents" (none from the provider: the fallback) or "provider+agents", from the
    spans' bases."""
    bases = set(bases)
    return "provider+agents" if len(bases) > 1 else bases.pop() if bases else "agents"


@dataclass
class Accounting:
    rounds: list[RoundStats] = field(default_factory=list)
    instance_seconds: float = 0.0  # sum over instances of their billed time (module docstring)
    billing_basis: str = "agents"  # provider | agents | provider+agents: where instance time came from
    kept_node_seconds: float = 0.0
    steps_kept: int = 0
    steps_lost: int = 0
    # Some round ended with no summary from any member: its steps lost past its last known step are not
    # counted, so `steps_lost` is a floor (shown as ">= N").
    steps_lost_lower_bound: bool = False
    reforms: int = 0  # rounds opened after the first, any cause
    failure_restarts: int = 0  # ... of which after a worker failure (bounded by --max-restarts)
    preemption_notices: int = 0
    reform_seconds: float = 0.0
    reform_basis: str = "steps"  # steps | rounds: what re-forming was timed from (module docstring)
    nodes: int = 0

    @property
    def reform_lower_bound(self) -> bool:
        """Re-forming was timed to the workers' start, not to training resumed: the true figure is more."""
        return self.reform_basis == "rounds"

    @property
    def steps_reported(self) -> bool:
        """Whether any round reported a training step: without one, kept and lost work are unknown."""
        return any(r.first_step is not None for r in self.rounds)

    @property
    def goodput(self) -> float | None:
        """Kept node-time over instance node-time; None when it cannot be known (see `goodput_note`).

        A script that prints no `train.step` lines (any plain torchrun script) would otherwise read as
        0 %: a false figure, worse than none.
        """
        if not self.steps_reported or self.instance_seconds <= 0:
            return None
        return self.kept_node_seconds / self.instance_seconds

    @property
    def goodput_note(self) -> str:
        """Why goodput is n/a, in a few words (empty when it is known)."""
        if self.instance_seconds <= 0:
            return "no node has started yet"
        if not self.steps_reported:
            return NO_STEPS
        return ""

    def to_dict(self) -> dict[str, Any]:
        """As JSON: kept and lost steps are null (n/a) when no step was reported, not 0. No `restarts` key:
        in petctl that word means failure restarts only (`failure_restarts`); every round is a re-form."""
        d = asdict(self)
        d["goodput"] = self.goodput
        d["goodput_note"] = self.goodput_note
        d["steps_reported"] = self.steps_reported
        d["reform_lower_bound"] = self.reform_lower_bound
        if not self.steps_reported:
            d["steps_kept"] = d["steps_lost"] = None
        return d


# Shown wherever goodput or lost steps would be: where the step numbers come from, and how to get them.
NO_STEPS = ("the script reports no training steps (Trainer/Lightning: callbacks=[PetctlCallback()]; "
            "a loop of your own: print train.step lines, see docs/getting-started.md)")


def account(events: Iterable[dict[str, Any]], now: float | None = None,
            billed: Iterable[BilledSpan] | None = None) -> Accounting:
    """Accounting for one job from all its nodes' events (any order; duplicates harmless), its instance
    time from the provider's `billed` record where there is one."""
    records = merge(events)
    acc = Accounting()
    acc.rounds = _rounds(records)
    _attribute_losses(acc.rounds)
    acc.steps_lost_lower_bound = any(r.unseen for r in acc.rounds[:-1])
    for r in acc.rounds:
        acc.steps_lost += r.steps_lost
        acc.steps_kept += r.kept_steps
        acc.kept_node_seconds += r.kept_node_seconds
    if acc.steps_reported:
        acc.reform_seconds, acc.reform_basis = _reform_by_steps(acc.rounds), "steps"
    else:
        acc.reform_seconds, acc.reform_basis = _reform_by_rounds(acc.rounds, records), "rounds"
    restarts = [e for e in records if e.get("event") == "rendezvous.restart"]
    acc.reforms = len({e.get("round") for e in restarts})
    acc.failure_restarts = len({e.get("round") for e in restarts if e.get("failure")})
    acc.preemption_notices = len({e.get("node") for e in records if e.get("event") == "preemption.notice"})
    spans = instance_spans(records, billed, now)
    acc.instance_seconds = sum(s.end - s.start for s in spans)
    acc.nodes = len({s.node for s in spans})
    acc.billing_basis = billing_basis(s.basis for s in spans)
    return acc


def _lowest_rank(records: list[dict[str, Any]], event: str) -> dict[int, dict[str, Any]]:
    """round -> the `event` of that round's lowest rank."""
    best: dict[int, dict[str, Any]] = {}
    for e in records:
        if e.get("event") != event or e.get("round") is None:
            continue
        n = int(e["round"])
        if n not in best or int(e.get("rank", 0)) < int(best[n].get("rank", 0)):
            best[n] = e
    return best


def _rounds(records: list[dict[str, Any]]) -> list[RoundStats]:
    """One RoundStats per round whose workers started: from the summary of its lowest rank (every node ran
    the same steps), or, for a round without one (still running, or every member killed), from its
    lowest rank's `workers.started`: no end, and its steps only as far as its workers' loads and saves
    tell (`_unseen_span`), when the job reports steps at all."""
    best = _lowest_rank(records, "round.summary")
    begun = _lowest_rank(records, "workers.started")
    causes = {int(e["round"]): str(e.get("cause", ""))
              for e in records if e.get("event") == "rendezvous.restart"}
    reports_steps = any(e.get("first_step") is not None for e in best.values())
    worker_steps = _worker_steps(records) if reports_steps and begun.keys() - best.keys() else {}
    rounds = []
    for n in sorted(best.keys() | begun.keys()):
        cause = causes.get(n, "job start" if n == 1 else "")
        if n not in best:
            e = begun[n]
            first, last = _unseen_span(worker_steps, n) if reports_steps else (None, None)
            rounds.append(RoundStats(round=n, world_size=int(e.get("world_size") or 0),
                                     started=float(e["ts"]), ended=None, first_step=first, last_step=last,
                                     first_step_ts=None, last_step_ts=None, cause=cause, unseen=True))
            continue
        e = best[n]
        rounds.append(RoundStats(
            round=n, world_size=int(e.get("world_size") or 0), started=float(e.get("started") or e["ts"]),
            ended=_f(e.get("ended")), first_step=_i(e.get("first_step")), last_step=_i(e.get("last_step")),
            first_step_ts=_f(e.get("first_step_ts")), last_step_ts=_f(e.get("last_step_ts")), cause=cause))
    return rounds


def _worker_steps(records: list[dict[str, Any]]) -> dict[tuple[str, int], list[int]]:
    """(event, round) -> the steps of the workers' `checkpoint.loaded` and `checkpoint.saved`, which their
    agents stamp with the round: read once for every unseen round."""
    out: dict[tuple[str, int], list[int]] = {}
    for e in records:
        name, n, step = e.get("event"), e.get("round"), e.get("step")
        if name in ("checkpoint.loaded", "checkpoint.saved") and n is not None and step is not None:
            out.setdefault((name, int(n)), []).append(int(step))
    return out


def _unseen_span(worker_steps: dict[tuple[str, int], list[int]], n: int) -> tuple[int | None, int | None]:
    """(first step, last step known) of round `n` from its workers' events (`_worker_steps`): it resumed
    after the step it loaded, and got at least as far as its newest save, else to the step before its
    first. (None, None) when no load says where it started."""
    loaded = worker_steps.get(("checkpoint.loaded", n))
    if not loaded:
        return None, None
    first = min(loaded) + 1
    return first, max([first - 1, *worker_steps.get(("checkpoint.saved", n), [])])


def _reform_by_steps(rounds: list[RoundStats]) -> float:
    """Last step of each round that trained to the first step of the next one that did."""
    trained = [r for r in rounds if r.first_step_ts is not None and r.last_step_ts is not None]
    total = 0.0
    for prev, nxt in zip(trained, trained[1:], strict=False):
        # Rounds that never reached a step (re-formed again at once) fall inside this gap.
        total += max(0.0, nxt.first_step_ts - prev.last_step_ts)  # type: ignore[operator]
    return total


def _reform_by_rounds(rounds: list[RoundStats], records: list[dict[str, Any]]) -> float:
    """Without steps: from each round's end as the agents saw it (its first worker failure, the restart
    that opened the next round, or its workers stopping, whichever came first) to the next round's
    workers starting. A round with no known end (no summary, no restart after it) adds nothing."""
    ends: dict[int, float] = {}
    for e in records:
        name = e.get("event")
        if name in ("workers.failed", "rendezvous.restart") and e.get("round") is not None:
            n = int(e["round"]) - (1 if name == "rendezvous.restart" else 0)  # the restart opens round n+1
            ends[n] = min(float(e["ts"]), ends.get(n, float("inf")))
    total = 0.0
    for prev, nxt in zip(rounds, rounds[1:], strict=False):
        end = min((t for t in (ends.get(prev.round), prev.ended) if t is not None), default=None)
        if end is not None:
            total += max(0.0, nxt.started - end)
    return total


def _step_time(r: RoundStats) -> float | None:
    """Seconds per step over the round's seen span; None without two timed steps."""
    if r.first_step is None or r.last_step is None or r.first_step_ts is None or r.last_step_ts is None:
        return None
    span = r.last_step - r.first_step
    return (r.last_step_ts - r.first_step_ts) / span if span > 0 else None


def _attribute_losses(rounds: list[RoundStats]) -> None:
    """Each round's kept and lost steps: a round keeps its steps up to the one before the next round's
    first (that round resumed there). An unseen round (no summary) got at least that far too, when the
    next round resumed inside its span; its step time is its world size's in the rounds that were seen."""
    seen: dict[int, list[float]] = {}
    for r in rounds:
        t = _step_time(r)
        if t is not None:
            seen.setdefault(r.world_size, []).append(t)
    for i, r in enumerate(rounds):
        if r.first_step is None or r.last_step is None:
            continue
        nxt = next((x for x in rounds[i + 1:] if x.first_step is not None), None)
        if nxt is not None and r.unseen and nxt.first_step - 1 >= r.first_step:  # type: ignore[operator]
            r.last_step = max(r.last_step, nxt.first_step - 1)  # type: ignore[operator]
        if nxt is not None:
            kept_last = min(r.last_step, nxt.first_step - 1)  # type: ignore[operator]
        else:
            kept_last = r.last_step  # the newest round: its steps count until proven lost
        r.kept_steps = max(0, kept_last - r.first_step + 1)
        r.steps_lost = max(0, r.last_step - kept_last)
        step_time = _step_time(r)
        if step_time is None:
            step_time = statistics.median(seen[r.world_size]) if r.unseen and seen.get(r.world_size) else 0.0
        r.kept_node_seconds = r.kept_steps * step_time * r.world_size


@dataclass
class NodeSpan:
    node: str
    start: float
    end: float
    start_event: dict[str, Any]
    running: bool  # no exit seen: still up (or vanished without a word)


def node_spans(events: Iterable[dict[str, Any]], now: float | None = None) -> list[NodeSpan]:
    """Each agent lifetime: its `agent.started` to its exit/leave, or to the provider's word that its
    instance ended (`instance.terminated`, the local reconciler's), or to its last event if it vanished
    without either (killed, frozen); one still running counts to `now` when given. Instance time and
    cost use this only for an instance the provider has no record of (`instance_spans`).

    Why the provider's word: an instance killed without a word used to count to `now` while the job ran
    and to its last event (often the round's start) once it ended, so instance-hours fell after
    `kill_job` (issue 25: 0.31 while running, 0.234 after)."""
    spans: list[NodeSpan] = []
    current: dict[str, NodeSpan] = {}
    for e in merge(events):
        ended = e.get("event") in ("agent.exit", "agent.left", "instance.terminated")
        node = e.get("node") or (e.get("instance") if e.get("event") == "instance.terminated" else None)
        if not node:
            continue
        ts = float(e["ts"])
        if e.get("event") == "agent.started":
            current[node] = NodeSpan(node, ts, ts, e, True)
            spans.append(current[node])
        elif node in current:
            current[node].end = ts
            if ended:
                current.pop(node).running = False
    if now is not None:
        for span in current.values():
            span.end = max(span.end, now)
    return spans


def _f(v: Any) -> float | None:
    return float(v) if v is not None else None


def _i(v: Any) -> int | None:
    return int(v) if v is not None else None
