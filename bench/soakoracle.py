"""The soak's oracle: what must hold of a job after every fault and at its end, as pure functions over
typed records parsed from the job's own ledgers and events. bench/soak.py reads the files (the I/O) and
calls these; tests/bench/test_soak_oracle.py feeds them hand-made histories, good and bad.

The invariants (`INVARIANTS`):
- recovery: after each fault the job trains again (a ledger step after the fault has cleared, in a newer
  round where the fault must re-form the job) within a bound per kind, or has ended for a stated reason.
  A fault that lands before an earlier one recovered extends the earlier one's bound by its own;
- stall: no gap between two steps (or since the last one) longer than STALL_LIMIT outside every fault's
  window: no silent stall;
- agreement: in every round each rank is held by one node, every node of a round has the same world
  size, each rank is below it, a node holds one rank per round, and the ledger's writer (rank 0) is the
  node that round ranked 0;
- redone: the steps a resume throws away stay within what the faults around it allow: 0 for announced
  and planned changes, K for an unannounced loss (the in-memory snapshot, taken every K steps: 1 unless
  the job's cadence said otherwise in `snapshot.every`), the durable interval when no node of the round
  before survived;
- weights: the final weights equal the reference run's within a float tolerance;
- accounting: `petctl status`'s steps kept and lost equal the ledger's;
- leftovers: after `kill_job`, no process, live etcd key, etcd user or snapshot file of the job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

INVARIANTS = ("recovery", "stall", "agreement", "redone", "weights", "accounting", "leftovers")

# Seconds from a fault's clearing to training again, on a loaded 2-core machine: detection (1-2 s), a
# re-form, a replacement's simulated boot (--replace-delay) and its warm workers' imports when capacity
# has to come back. A notice adds its window (the hand-off may wait for the replacement until then).
BOUND = {"kill": 60.0, "freeze": 60.0, "term": 45.0, "notice": 60.0, "rebalance": 60.0,
         "worker_crash": 60.0, "scale_up": 60.0, "scale_down": 45.0, "burst": 60.0, "etcd_stall": 45.0,
         "etcd_down": 60.0, "joiner_lost": 60.0, "notice_in_reform": 60.0}

# Kinds that must re-form the job (training again means a step of a newer round), unless the fault asked
# for nothing the round lacks (`needs_reform`): a scale to the world size the job has, a freeze of every
# member at once (nobody is left to drop anyone: thawed, they train on in the same round), or a freeze too
# short to be sure of (below).
REFORMS = frozenset({"kill", "freeze", "term", "notice", "worker_crash", "scale_up", "scale_down", "burst",
                     "joiner_lost", "notice_in_reform"})
SCALES = frozenset({"scale_up", "scale_down", "burst"})

# Steps a resume may redo because of a fault of this kind, in snapshot intervals: announced and planned
# changes save first (0), an unannounced loss resumes from the newest in-memory snapshot (at most one
# interval: K steps, where K is the snapshot cadence in force, `Cadence`).
REDO_ALLOWED = {"kill": 1, "freeze": 1, "worker_crash": 1, "joiner_lost": 1, "notice_in_reform": 1,
                "term": 0, "notice": 0, "rebalance": 0, "scale_up": 0, "scale_down": 0, "burst": 0,
                "etcd_stall": 0, "etcd_down": 0}

# A frozen node's liveness lease expires at most its TTL after its last refresh, which came before the
# freeze, and etcd's lessor checks expiries every 0.5 s. A freeze longer than TTL + LEASE_SLACK is always
# seen, so the round must re-form without the node. A shorter one may be ridden out: the peer watch drops a
# silent member sooner, but rightly holds back when the watcher's own refreshes lag (a loaded host), and
# then the node thaws before its lease ends and the round trains on. Either outcome is correct there.
LEASE_SLACK = 1.0

STALL_LIMIT = 30.0  # seconds without a step, outside every fault's window, that is a stall


# --- records ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """A step the job ran (rank 0's ledger line, written once every rank finished it)."""

    ts: float
    step: int
    round: int
    world: int
    node: str


@dataclass(frozen=True)
class Resume:
    """A round's workers started and resumed at `start` (the first step they will run)."""

    ts: float
    start: int
    round: int
    world: int
    node: str


@dataclass(frozen=True)
class Join:
    """A node's `rendezvous.complete`: the round it joined, its rank and the world size it was told."""

    ts: float
    node: str
    round: int
    rank: int
    world: int


@dataclass(frozen=True)
class Cadence:
    """A node's snapshot interval from `ts` on: K = `every` steps (`snapshot.enabled` starts a worker's
    at 1, or at its fixed K; `snapshot.every` reports each change the cadence makes under load)."""

    ts: float
    node: str
    every: int


def every_at(cadences: Sequence[Cadence], nodes: Iterable[str], ts: float) -> int:
    """The snapshot interval in force at `ts`: the largest any of `nodes` had last set by then (the
    newest snapshot a survivor holds is at most that many steps old); 1 when none said."""
    latest: dict[str, tuple[float, int]] = {}
    for c in cadences:
        if c.ts <= ts and (c.node not in latest or c.ts >= latest[c.node][0]):
            latest[c.node] = (c.ts, c.every)
    return max((latest[n][1] for n in nodes if n in latest), default=1)


@dataclass(frozen=True)
class Fault:
    """A fault as it was carried out. `cleared`: when its effect ended (the thaw, etcd back; the
    injection itself for an instant fault). `round_at`: the job's round at injection. `skipped`: why it
    was not injected (then it is not judged)."""

    index: int
    kind: str
    injected: float
    cleared: float
    round_at: int
    target: str = ""
    grace: float = 0.0
    skipped: str = ""
    size: int | None = None  # a scale fault's desired size, once carried out

    @property
    def reforms(self) -> bool:
        return self.kind in REFORMS

    @property
    def bound(self) -> float:
        return BOUND[self.kind] + (self.grace if self.kind in ("notice", "rebalance", "notice_in_reform")
                                   else 0.0)


@dataclass(frozen=True)
class Violation:
    """One broken invariant, with the first event that broke it."""

    invariant: str
    message: str
    context: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Outcome:
    """How one fault ended: `recovered` (training again `seconds` after the injection), `ended` (the job
    ended first, `how` says why), `pending` (its bound has not passed yet), `hung` (a violation),
    `skipped`."""

    index: int
    kind: str
    state: str
    seconds: float | None
    deadline: float | None
    how: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JobEnd:
    """The job's end, if it ended: when, its state, and the reason it gave."""

    ts: float
    state: str
    reason: str


# --- recovery and stalls ----------------------------------------------------------------------------------
def _all_frozen_at_once(f: Fault, members: set[str], faults: Sequence[Fault]) -> bool:
    """Some moment of freeze `f` had every one of `members` frozen (by `f` or overlapping freezes)."""
    freezes = [g for g in faults if g.kind == "freeze" and not g.skipped and g.target in members]
    for t in sorted({f.injected, *(g.injected for g in freezes)}):
        if f.injected <= t <= f.cleared and members <= {g.target for g in freezes
                                                          if g.injected <= t <= g.cleared}:
            return True
    return False


def _superseded(f: Fault, faults: Sequence[Fault], steps: Sequence[Step]) -> bool:
    """A later scale fault set another size before `f`'s was reached (no step of a newer round came
    between them): the job owes the later one its size, judged on its own, not this one's."""
    later = next((g for g in faults if g.kind in SCALES and not g.skipped and g.size is not None
                  and g.injected > f.injected), None)
    return later is not None and not any(f.cleared < s.ts <= later.injected and s.round > f.round_at
                                         for s in steps)


def needs_reform(f: Fault, faults: Sequence[Fault], steps: Sequence[Step], joins: Sequence[Join],
                 lease: float | None = None) -> bool:
    """Whether training again after `f` must be a step of a newer round (REFORMS). Not when the fault asked
    for nothing the round lacks:
    - a scale to the world size the job trained at when it was injected, or one a later scale superseded
      before it was reached;
    - a freeze no longer than the liveness lease `lease` (the heartbeat TTL) + LEASE_SLACK: the round may
      ride it out;
    - a freeze while every member of the round was frozen: no one could drop anyone; thawed, the round
      goes on.
    Without the round's members (`joins`), the scale's size or the lease, a re-form is required."""
    if not f.reforms:
        return False
    if f.kind in SCALES and f.size is not None:
        world = next((s.world for s in reversed(steps) if s.ts <= f.injected), None)
        return world != f.size and not _superseded(f, faults, steps)
    if f.kind == "freeze":
        if lease is not None and f.cleared - f.injected <= lease + LEASE_SLACK:
            return False
        members = {j.node for j in joins if j.round == f.round_at}
        return not (members and _all_frozen_at_once(f, members, faults))
    return True


def _recovered_at(fault: Fault, steps: Sequence[Step], reform: bool) -> float | None:
    for s in steps:
        if s.ts > fault.cleared and (not reform or s.round > fault.round_at):
            return s.ts
    return None


def recoveries(faults: Sequence[Fault], steps: Sequence[Step], now: float, end: JobEnd | None = None,
               joins: Sequence[Join] = (), lease: float | None = None
               ) -> tuple[list[Outcome], list[Violation]]:
    """Each fault's outcome, and a violation for each that neither trained again nor saw the job end by
    its deadline. Deadline: cleared + the kind's bound, extended to a later fault's own deadline when that
    fault landed before this one recovered and before its deadline (it may hold the job up as long; one
    that lands after the deadline rescues nothing). Training again is a step after the fault cleared, in
    a newer round when the fault needs one (`needs_reform`, from `joins` and the job's heartbeat TTL
    `lease`). `steps` in time order."""
    live = [f for f in faults if not f.skipped]
    found = {f.index: _recovered_at(f, steps, needs_reform(f, faults, steps, joins, lease)) for f in live}
    deadline = {f.index: f.cleared + f.bound for f in live}
    for i, f in enumerate(live):  # a later fault that landed while this one was still within its bound
        for g in live[i + 1:]:
            at = found[f.index]
            until = deadline[f.index] if at is None else min(at, deadline[f.index])
            if g.injected <= until:
                deadline[f.index] = max(deadline[f.index], g.cleared + g.bound)
    outcomes, violations = [], []
    for f in faults:
        if f.skipped:
            outcomes.append(Outcome(f.index, f.kind, "skipped", None, None, f.skipped))
            continue
        at, due = found[f.index], deadline[f.index]
        if at is not None and at <= due:
            outcomes.append(Outcome(f.index, f.kind, "recovered", round(at - f.injected, 3), due))
        elif end is not None and end.ts <= due and end.reason:
            outcomes.append(Outcome(f.index, f.kind, "ended", None, due, f"{end.state}: {end.reason}"))
        elif at is None and now <= due:
            outcomes.append(Outcome(f.index, f.kind, "pending", None, due))
        else:
            outcomes.append(Outcome(f.index, f.kind, "hung", None, due))
            last = next((s for s in reversed(steps) if s.ts <= due), None)
            violations.append(Violation(
                "recovery", f"fault {f.index} ({f.kind} {f.target}) not training again within "
                            f"{due - f.injected:.0f}s"
                            + (f" (it did {at - f.injected:.1f}s after)" if at else ""),
                {"fault": asdict(f), "last_step_before_deadline": asdict(last) if last else None}))
    return outcomes, violations


def stalls(steps: Sequence[Step], faults: Sequence[Fault], outcomes: Sequence[Outcome], now: float,
           limit: float = STALL_LIMIT, end: JobEnd | None = None) -> list[Violation]:
    """Gaps of more than `limit` s between steps (and from the last step to `now`, or to the job's end)
    that no fault's window [injection, deadline] overlaps: a stall nobody caused. `steps` in time order."""
    windows = [(f.injected, o.deadline) for f, o in zip(faults, outcomes, strict=True)
               if o.deadline is not None]
    times = [s.ts for s in steps] + [end.ts if end is not None else now]
    out = []
    for a, b in zip(times, times[1:], strict=False):
        if b - a <= limit:
            continue
        bare = _uncovered(a, b, windows)
        if bare:
            lo, hi = bare
            out.append(Violation("stall", f"no step for {hi - lo:.1f}s with no fault under way (a gap of "
                                          f"{b - a:.1f}s)", {"from": lo, "to": hi}))
    return out


def _uncovered(a: float, b: float, windows: Sequence[tuple[float, float]],
               limit: float = STALL_LIMIT) -> tuple[float, float] | None:
    """The first stretch of (a, b) longer than `limit` that no window covers, if any."""
    cursor = a
    for lo, hi in sorted(w for w in windows if w[0] < b and a < w[1]):
        if lo - cursor > limit:
            return cursor, lo
        cursor = max(cursor, hi)
    return (cursor, b) if b - cursor > limit else None


# --- agreement --------------------------------------------------------------------------------------------
def agreement(joins: Iterable[Join], steps: Iterable[Step]) -> list[Violation]:
    """Per round: one node per rank, one rank per node, one world size, every rank below it, and the
    ledger's writer is the node that round ranked 0."""
    rounds: dict[int, list[Join]] = {}
    for j in joins:
        rounds.setdefault(j.round, []).append(j)
    out = []
    for n, members in sorted(rounds.items()):
        by_rank: dict[int, set[str]] = {}
        by_node: dict[str, set[int]] = {}
        for j in members:
            by_rank.setdefault(j.rank, set()).add(j.node)
            by_node.setdefault(j.node, set()).add(j.rank)
        ctx = {"round": n, "members": sorted((j.node, j.rank, j.world) for j in members)}
        if any(len(nodes) > 1 for nodes in by_rank.values()):
            out.append(Violation("agreement", f"round {n}: a rank held by two nodes", ctx))
        if any(len(ranks) > 1 for ranks in by_node.values()):
            out.append(Violation("agreement", f"round {n}: a node told two ranks", ctx))
        worlds = {j.world for j in members}
        if len(worlds) > 1:
            out.append(Violation("agreement", f"round {n}: nodes disagree on the world size {sorted(worlds)}",
                                 ctx))
        if any(not 0 <= j.rank < j.world for j in members):
            out.append(Violation("agreement", f"round {n}: a rank outside its world", ctx))
    writers: dict[int, set[str]] = {}
    for s in steps:
        writers.setdefault(s.round, set()).add(s.node)
    for n, nodes in sorted(writers.items()):
        zero = {j.node for j in rounds.get(n, []) if j.rank == 0}
        if zero and nodes != zero:
            out.append(Violation("agreement", f"round {n}: steps written by {sorted(nodes)}, rank 0 is "
                                              f"{sorted(zero)}", {"round": n}))
    return out


# --- steps redone -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Redo:
    """One resume: the round, when, where it resumed, how many steps it threw away, how many it might."""

    round: int
    ts: float
    start: int
    redone: int
    allowed: int
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def redos(steps: Sequence[Step], resumes: Sequence[Resume], faults: Sequence[Fault],
          outcomes: Sequence[Outcome], joins: Sequence[Join], durable_every: int,
          cadences: Sequence[Cadence] = ()) -> list[Redo]:
    """Each resume after the first: the steps run past its start and thrown away (run again), and what
    the faults whose window (injection to recovery, or to the deadline) holds it allow (REDO_ALLOWED, the
    most of them, in snapshot intervals: K steps each, K the interval the newest trained round's nodes had
    in force (`every_at` over `cadences`); `durable_every` when no node of that round survived into this
    one). No fault about: 0."""
    members: dict[int, set[str]] = {}
    for j in joins:
        members.setdefault(j.round, set()).add(j.node)
    windows = [(f, f.injected + o.seconds if o.seconds is not None else o.deadline)
               for f, o in zip(faults, outcomes, strict=True) if o.deadline is not None]
    events = sorted([(s.ts, 1, s) for s in steps] + [(r.ts, 0, r) for r in resumes], key=lambda e: e[:2])
    frontier, trained_round, out = -1, None, []
    for _, _, e in events:
        if isinstance(e, Step):
            frontier = max(frontier, e.step)
            trained_round = e.round
            continue
        if trained_round is None:
            frontier = max(frontier, e.start - 1)
            continue
        redone = max(0, frontier - e.start + 1)
        near = [f for f, due in windows if f.injected <= e.ts <= due]
        before, now = members.get(trained_round, set()), members.get(e.round, set())
        every = every_at(cadences, before, e.ts)
        allowed = max((REDO_ALLOWED[f.kind] * every for f in near), default=0)
        why = ", ".join(f"{f.kind}#{f.index}" for f in near) or "no fault"
        if near and every > 1:
            why += f"; snapshots every {every} steps"
        if near and before and now and not before & now:
            allowed, why = max(allowed, durable_every), why + "; no node of the round before survived"
        out.append(Redo(e.round, e.ts, e.start, redone, allowed, why))
        frontier = e.start - 1
    return out


def redo_violations(found: Iterable[Redo], steps: Sequence[Step]) -> list[Violation]:
    """A resume that threw away more than it might; a resume past every step run (a step skipped).

    One exception to the second: a single step missing just before a resume next to an unannounced loss
    (allowed >= 1). Rank 0 writes a step's line after the step's collective, so a rank 0 killed between
    the two takes the line with it while the survivors hold the step (their snapshot resumes after it);
    the final weights still show a step that really was skipped."""
    out = []
    found = list(found)
    for r in found:
        if r.redone > r.allowed:
            out.append(Violation("redone", f"round {r.round} resumed at step {r.start}: {r.redone} steps "
                                           f"redone, {r.allowed} allowed ({r.why})", r.to_dict()))
    lost_lines = {r.start - 1 for r in found if r.allowed >= 1}
    ran: set[int] = set()
    for s in steps:
        if s.step - 1 in lost_lines and s.step - 1 not in ran and (s.step < 2 or s.step - 2 in ran):
            ran.add(s.step - 1)
        if s.step > 0 and s.step - 1 not in ran:
            out.append(Violation("redone", f"step {s.step} ran before step {s.step - 1} ever did (a step "
                                           f"skipped)", asdict(s)))
            break
        ran.add(s.step)
    return out


# --- the end ----------------------------------------------------------------------------------------------
def weights(expected: Sequence[float], got: Sequence[float] | None, tol: float = 1e-9) -> list[Violation]:
    """The final weights against the reference run's, within `tol` (max absolute difference)."""
    if got is None:
        return [Violation("weights", "no final weights: the job did not finish its steps")]
    if len(got) != len(expected):
        return [Violation("weights", f"{len(got)} final weights, the reference has {len(expected)}")]
    dw = max((abs(a - b) for a, b in zip(expected, got, strict=True)), default=0.0)
    if not dw <= tol or any(math.isnan(v) for v in got):
        return [Violation("weights", f"final weights differ from the reference: max |dw| = {dw:.3g}",
                          {"max_abs_diff": dw, "tol": tol})]
    return []


def ledger_totals(steps: Sequence[Step], found: Sequence[Redo]) -> dict[str, int]:
    """What the ledger says was kept (distinct steps) and lost (steps redone)."""
    return {"steps_kept": len({s.step for s in steps}), "steps_lost": sum(r.redone for r in found)}


def accounting(status_accounting: dict[str, Any] | None, totals: dict[str, int]) -> list[Violation]:
    """`petctl status`'s accounting against the ledger's totals (steps kept and lost). Kept steps must be
    equal. Lost steps too, unless status says its figure is a floor (`steps_lost_lower_bound`: a round
    every member of which died wrote no summary, so what it ran past its last known step is unknown):
    then the ledger must hold at least that many."""
    if not status_accounting:
        return [Violation("accounting", "status has no accounting")]
    got = {k: status_accounting.get(k) for k in totals}
    floor = bool(status_accounting.get("steps_lost_lower_bound"))
    lost, truth = got.get("steps_lost"), totals.get("steps_lost")
    lost_ok = lost == truth or (floor and isinstance(lost, int) and isinstance(truth, int) and lost <= truth)
    if got.get("steps_kept") != totals.get("steps_kept") or not lost_ok:
        return [Violation("accounting", f"status says {got}{' (lost: a floor)' if floor else ''}, the "
                                        f"ledger {totals}",
                          {"status": got, "ledger": totals, "lost_is_floor": floor})]
    return []


@dataclass(frozen=True)
class Leftovers:
    """What is left of a job after `kill_job`: its processes, its live etcd keys (heartbeats, the round
    not final), its etcd users, its snapshot files."""

    processes: list[str] = field(default_factory=list)
    live_keys: list[str] = field(default_factory=list)
    etcd_users: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def leftovers(found: Leftovers) -> list[Violation]:
    """One violation per kind of thing left behind."""
    out = []
    for name, items in asdict(found).items():
        if items:
            out.append(Violation("leftovers", f"after kill_job, {len(items)} {name.replace('_', ' ')} left: "
                                              f"{items[:5]}", {name: items}))
    return out


# --- the summary ------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


def recovery_table(outcomes: Iterable[Outcome]) -> dict[str, dict[str, Any]]:
    """Per kind: how many faults, how many recovered, recovery p50 and p99 (seconds)."""
    table: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        row = table.setdefault(o.kind, {"faults": 0, "recovered": 0, "seconds": []})
        row["faults"] += 1
        if o.state == "recovered" and o.seconds is not None:
            row["recovered"] += 1
            row["seconds"].append(o.seconds)
    return {k: {"faults": v["faults"], "recovered": v["recovered"], "p50": percentile(v["seconds"], 50),
                "p99": percentile(v["seconds"], 99)} for k, v in sorted(table.items())}


def summary_line(seed: int, outcomes: Sequence[Outcome], violations: Sequence[Violation]) -> str:
    """The run in one line: seed, faults, violations, recovery p50/p99 over all and per kind."""
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    table = recovery_table(o for o in outcomes if o.state != "skipped")
    every = [o.seconds for o in outcomes if o.state == "recovered" and o.seconds is not None]
    kinds = " ".join(f"{k}={fmt(r['p50'])}/{fmt(r['p99'])}" for k, r in table.items())
    injected = sum(1 for o in outcomes if o.state != "skipped")
    return (f"soak seed={seed}: {injected} faults, {len(violations)} violations, recovery p50/p99 "
            f"{fmt(percentile(every, 50))}/{fmt(percentile(every, 99))} s; per kind {kinds}")
