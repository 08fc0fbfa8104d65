"""The rendezvous' rules and what they read: the typed view of etcd (`StoreView`, `Members`,
`RoundInfo`: plain values, no I/O, no clock) and `decide`, the pure decision of what this node does next.

Sections: the view (what an agent knows at one moment; the round judges in roundjudge.py read it too); the
decisions.

The rendezvous' decisions as one pure function: given what etcd holds, what this node does next.

Split as torch's `dynamic_rendezvous.py` splits it: `decide(view, state, settings, now)` reads typed
records and returns one `Action` and this node's updated `RendezvousState`; rendezvous.py performs the
action (etcd compare-and-swap) and calls `decide` again on a fresh view. Nothing here does I/O, reads a
clock or keeps state between calls, so every rule is a row in tests/agent/test_round_decisions.py.

The rules (docs/ARCHITECTURE.md has the whole protocol):
- No round yet: open round 1 (or, if this node saw a round before, the store was wiped: open the next
  one, keeping the restart count: `opening_round`). A `final` round: the job is over.
- While the view is not `settled` (etcd just failed or stalled: agent/health.py), absences are
  not trusted: no round is frozen and no job fails below `min` until it settles.
- Fewer than `min` nodes alive for `join_timeout`: end the job `failed`.
- Joining: write our join record once per round. The *closer* is the first live joiner in (previous rank,
  join order), so rank 0 stays rank 0 and old members keep their order; only it decides, the others wait.
  It freezes the round once >= `min` have joined and every live node has joined, or `max` is reached, or
  `last_call` has passed since `min` was reached; in round 1 it first waits `initial_wait` for `size`.
- Expected members: live members of the round this one replaced (`Round.prev_ranks`) are still stopping
  their workers. The closer waits for them up to `stop_grace` + `EXPECT_MARGIN`, and for the previous
  rank 0 as long as it is alive (bounded only by `join_timeout`, so no single node can wedge the job).
  Else a newcomer froze a round alone while members still stopped: an extra restart, rank 0 moved.
- Frozen: a member is admitted. A live node outside it waits; if every member is gone it opens the next
  round itself, since nobody else will.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from petctl.core.records import JoinRecord, NodeRecord, Phase, Round
from petctl.core.spec import JobSpec

# --- the view -----------------------------------------------------------------------------------------------
# What an agent knows about its job at one moment, as plain typed values (no I/O, no clock).
#
# The rendezvous executor (rendezvous.py) reads etcd into these; the decisions (below, and roundjudge.py)
# read only these. Keeping them apart from both is what lets the decisions be tested by tables.

@dataclass(frozen=True)
class StoreView:
    """The `live/` prefix as of one etcd index."""

    alive: frozenset[str] = frozenset()  # nodes whose heartbeat key exists
    nodes: Mapping[str, NodeRecord] = field(default_factory=dict)  # their heartbeat values, where readable
    round: Round | None = None
    round_index: int | None = None  # the modifiedIndex of `live/round`: what a CAS on it compares
    done: Mapping[int, frozenset[str]] = field(default_factory=dict)  # round -> nodes done in it
    mixed: Mapping[int, Mapping[str, str]] = field(default_factory=dict)  # round -> {done node: its failure}
    etcd_index: int = 0
    # False while etcd recently failed, stalled or lost our own heartbeat (agent/health.py): a node
    # missing from `alive` may then be an expiry of the outage, not a loss, so nobody is judged by it.
    settled: bool = True

    def done_in(self, round_no: int) -> frozenset[str]:
        return self.done.get(round_no, frozenset())


@dataclass(frozen=True)
class Member:
    """One join record of a joining round, with the etcd index that orders arrivals."""

    record: JoinRecord
    created: int


@dataclass(frozen=True)
class Members:
    """The join records of round `round`, as read when the view had index `read_at`.

    While the view's index is still `read_at` nothing in etcd changed, so they are still current.
    """

    round: int
    records: Mapping[str, Member]
    read_at: int


@dataclass(frozen=True)
class RoundInfo:
    """This node's place in a frozen round: what its workers are started with."""

    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    ranks: Mapping[str, int]
    restarts: int
    cause: str
    started: float  # when this round was opened (for recovery timing)
    # The frozen round as read: what a node writes back if etcd lost it (not part of a RoundInfo's identity).
    record: Round | None = field(default=None, compare=False)

    @classmethod
    def of(cls, rnd: Round, node_id: str) -> RoundInfo:
        """Our place in `rnd`. Raises ValueError if it is not frozen or we are not in it."""
        if rnd.phase is not Phase.FROZEN or node_id not in rnd.ranks or rnd.round is None:
            raise ValueError(f"{node_id} is not a member of round {rnd.round} ({rnd.phase.value})")
        return cls(round=rnd.round, rank=rnd.ranks[node_id], world_size=len(rnd.ranks),
                   master_addr=rnd.master_addr, master_port=rnd.master_port, ranks=dict(rnd.ranks),
                   restarts=rnd.restarts, cause=rnd.cause, started=rnd.ts, record=rnd)


# --- the decisions ------------------------------------------------------------------------------------------

EXPECT_MARGIN = 3.0  # beyond stop_grace: seeing the new round (a periodic view at worst) and joining it
POLL_FAST = 0.05  # the closer's poll while a live node has not joined (join records are not watched)
POLL_SLOW = 0.5  # ... once an expected member has been slow for EXPECT_FAST_FOR
EXPECT_FAST_FOR = 0.5
IDLE = 1.0  # a wait with nothing due: the watch wakes us sooner for anything that matters
WHOLE_READS_PER_S = 100.0  # the fleet's budget of re-reads of live/ whole that no watch event asked for


def safety_period(base: float, nodes: int, node_id: str) -> float:
    """How long a node goes without reading `live/` whole when no watch event wakes it: about `base` in
    a fleet of up to `WHOLE_READS_PER_S * base` nodes, then in proportion to the fleet, so that these
    safety-net reads stay at most `WHOLE_READS_PER_S` a second across it; spread per node
    (`read_spread`) from 0.55 to 1.65 times that, which keeps the fleet's mean rate within the budget
    (the mean of 1 / (1.1 * (0.5 + u)) over u uniform in [0, 1) is ln 3 / 1.1 < 1).

    Why: each such read returns every node's key, so at a fixed period the store's work grows with N²:
    with 1000 nodes re-reading every second (`IDLE`), a million keys a second, and the fleet bench
    (bench/fleet.py, `--model agent`) never ranked 1000 nodes. What a watch reports (a round, a member
    joining or leaving while we follow `live/`) still wakes a node at once; what waits for this period is
    only what no watch covers: a paused joiner noticing that the closer is gone. The spread is there
    because nodes start their waits together (a round change wakes every waiting joiner at once): with
    one period for all, their reads came in one burst each period, 1000 whole reads within a second on
    the fleet bench, which held its event loops for up to 0.9 s and made keep-alives late."""
    return max(base, nodes / WHOLE_READS_PER_S) * 1.1 * (0.5 + read_spread(node_id))


def read_spread(node_id: str) -> float:
    """This node's fixed place in [0, 1), from a hash of its id: the same on every call (no random
    state), different across a fleet's nodes."""
    return zlib.crc32(node_id.encode()) / 2**32


def first_look_after(rank: int) -> float:
    """Seconds after its workers start before a newly ranked node first reads `live/` whole (when no
    watch event asks sooner): its rank spread over `WHOLE_READS_PER_S`, so rank 0 looks at once, rank 7
    after 70 ms, and the 1000 nodes of one round after at most 10 s, 100 a second.

    Why: a node is admitted on the round record alone (`admitted_by`) and follows `live/` from the
    round's freeze on (`LiveWatcher.resume`), so it misses only what changed between the closer's view
    and the freeze (a member lost in that gap). Looking at once on every node made each freeze cost
    etcd N whole reads at the same moment (a million keys at 1000 nodes, on the fleet bench)."""
    return max(0, rank) / WHOLE_READS_PER_S


def admitted_by(rnd: Round | None, node_id: str) -> RoundInfo | None:
    """Our place in `rnd` when it is a frozen round that ranks us, else None: what a waiting joiner
    learns from the round record alone (one key), without reading every node's key under `live/`."""
    if rnd is None or rnd.phase is not Phase.FROZEN or node_id not in rnd.ranks or rnd.round is None:
        return None
    return RoundInfo.of(rnd, node_id)


@dataclass(frozen=True)
class Settings:
    """The job's knobs, as the decisions need them."""

    node_id: str
    min_nodes: int
    max_nodes: int
    initial_size: int
    last_call: float
    initial_wait: float
    join_timeout: float
    stop_grace: float
    max_restarts: int = 3

    @classmethod
    def of(cls, node_id: str, spec: JobSpec) -> Settings:
        t = spec.timeouts
        return cls(node_id=node_id, min_nodes=spec.min_size, max_nodes=spec.max_size,
                   initial_size=min(spec.max_size, max(spec.min_size, spec.size or spec.min_size)),
                   last_call=t.last_call, initial_wait=t.initial_wait, join_timeout=t.join_timeout,
                   stop_grace=t.stop_grace, max_restarts=spec.max_restarts)

    @property
    def expect_for(self) -> float:
        """How long a closer waits for a live member of the previous round (other than its rank 0)."""
        return self.stop_grace + EXPECT_MARGIN


@dataclass(frozen=True)
class Now:
    mono: float  # time.monotonic(): intervals this node measures itself
    wall: float  # time.time(): only to compare with timestamps other nodes wrote (`Round.ts`)


@dataclass(frozen=True)
class RendezvousState:
    """What one node remembers between two decisions of one rendezvous."""

    started: float  # monotonic start of this rendezvous (reported in `rendezvous.complete`)
    prev_rank: int | None = None  # our rank in the round before, written into our join record
    joined_round: int | None = None  # the round our join record is for
    joined_at: float | None = None  # monotonic: when we joined it (expected members are waited from here)
    members: Members | None = None  # join records of the joining round, as last read
    ahead: frozenset[str] = frozenset()  # live joiners sorted before us at that read
    below_min_since: float | None = None
    min_reached_at: float | None = None  # the closer: when >= min had joined (last_call runs from here)
    waiting_reported: bool = False


# --- actions -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenFirstRound:
    """Create round 1 (`prevExist=False`: one creator wins)."""


@dataclass(frozen=True)
class Join:
    round: int
    prev_rank: int | None


@dataclass(frozen=True)
class ReadMembers:
    round: int


@dataclass(frozen=True)
class Freeze:
    """CAS `live/round` from `index` to `value` (the frozen round); then forget the round before."""

    value: Round
    index: int


@dataclass(frozen=True)
class StartNextRound:
    cause: str
    failure: bool = False


@dataclass(frozen=True)
class EndJob:
    state: str
    reason: str
    round: int | None


@dataclass(frozen=True)
class Wait:
    timeout: float
    watch_membership: bool = True  # False: pause the `live/` watch (only round changes wake us)
    waiting_for_world: int | None = None  # report once: alive, outside a frozen round of this size


@dataclass(frozen=True)
class Admitted:
    info: RoundInfo


@dataclass(frozen=True)
class Ended:
    state: str
    reason: str


Action = OpenFirstRound | Join | ReadMembers | Freeze | StartNextRound | EndJob | Wait | Admitted | Ended


# --- the decision ----------------------------------------------------------------------------------
def decide(view: StoreView, state: RendezvousState, s: Settings,
           now: Now) -> tuple[Action, RendezvousState]:
    """What to do next, and the state to pass to the next call once it is done."""
    rnd = view.round
    if rnd is None:
        return OpenFirstRound(), state
    if rnd.phase is Phase.FINAL:
        return Ended(rnd.state or "unknown", rnd.reason), state
    round_no = rnd.round or 0
    if len(view.alive) < s.min_nodes:
        since = state.below_min_since if state.below_min_since is not None else now.mono
        state = dataclasses.replace(state, below_min_since=since)
        if now.mono - since > s.join_timeout and view.settled:
            return EndJob("failed", f"fewer than min={s.min_nodes} nodes for {s.join_timeout:.0f}s",
                          round_no), state
    elif state.below_min_since is not None:
        state = dataclasses.replace(state, below_min_since=None)
    if rnd.phase is Phase.JOINING:
        return _joining(view, rnd, round_no, state, s, now)
    return _frozen(view, rnd, state, s)


def from_round_alone(rnd: Round | None, state: RendezvousState, s: Settings,
                     now: Now) -> tuple[Action | None, RendezvousState]:
    """What this node does next when the round record is all it knows, or None where that takes every
    node's key (`decide` on a whole view): open the first round, end with the job, join a joining round
    it has not joined, or take its place in a frozen round that ranks it. Each is what `decide` returns
    on any view with this round (the node count matters only once it has joined, or outside a frozen
    round). Why: at a mass join every node's first look was a whole read of `live/`, N keys each, so
    the fleet read N² keys before anyone had joined."""
    if rnd is None:
        return OpenFirstRound(), state
    if rnd.phase is Phase.FINAL:
        return Ended(rnd.state or "unknown", rnd.reason), state
    if rnd.phase is Phase.FROZEN:
        info = admitted_by(rnd, s.node_id)
        return (Admitted(info) if info is not None else None), state
    if state.joined_round != (rnd.round or 0):
        return _join(rnd, state, s, now)
    return None, state


def looks_for_one_ahead(rnd: Round, state: RendezvousState) -> bool:
    """Whether a joiner of `rnd` first looks for one live joiner ahead of it (a few keys) before it
    judges on the whole view: yes while it has joined this joining round, unless the whole view already
    found it the closer in this round (no one ahead in the join records it read). The closer stays on
    the whole view, which re-reads the join records whenever etcd changed, so a previous rank that
    joins after it still takes the round over; a search for one ahead would only add a read per wake."""
    if rnd.phase is not Phase.JOINING or state.joined_round != rnd.round:
        return False
    judged_closer = not state.ahead and state.members is not None and state.members.round == rnd.round
    return not judged_closer


def _join(rnd: Round, state: RendezvousState, s: Settings, now: Now) -> tuple[Action, RendezvousState]:
    """Join `rnd`: as a newcomer where the round it replaced was formed without us, else with our rank."""
    prev_rank = None if rnd.prev_ranks and s.node_id not in rnd.prev_ranks else state.prev_rank
    return Join(rnd.round or 0, prev_rank), dataclasses.replace(
        state, prev_rank=prev_rank, joined_round=rnd.round or 0, joined_at=now.mono, min_reached_at=None,
        members=None, ahead=frozenset())


def _joining(view: StoreView, rnd: Round, round_no: int, state: RendezvousState, s: Settings,
             now: Now) -> tuple[Action, RendezvousState]:
    if state.joined_round != round_no:
        return _join(rnd, state, s, now)
    known = state.ahead and state.ahead <= view.alive
    if known:  # not the closer, and nobody ahead of us left: only a round change matters to us
        return Wait(safety_period(IDLE, len(view.alive), s.node_id), watch_membership=False), state
    members = state.members
    if members is None or members.round != round_no or members.read_at != view.etcd_index:
        return ReadMembers(round_no), state
    if s.node_id not in view.alive:  # our heartbeat expired (a store outage): wait until it is re-asserted
        return Wait(POLL_SLOW), state
    live = {n: m for n, m in members.records.items() if n in view.alive}
    if s.node_id not in live:  # our record vanished (should not happen): write it again
        return Join(round_no, state.prev_rank), dataclasses.replace(state, members=None, ahead=frozenset())
    order = closing_order(live, rnd.prev_ranks)
    state = dataclasses.replace(state, ahead=frozenset(order[: order.index(s.node_id)]))
    if state.ahead:
        return Wait(safety_period(IDLE, len(view.alive), s.node_id), watch_membership=False), state
    return _close(view, rnd, live, order, state, s, now)


def closing_order(live: dict[str, Member], prev_ranks: Mapping[str, int] | None = None) -> list[str]:
    """Joiners in rank order: previous ranks first (rank 0 stays rank 0), then newcomers by arrival.

    The round's `prev_ranks` decide (a node the last round formed without is new, whatever its record
    claims, else a healed old rank 0 takes rank 0 back); a round opened with none uses the records'.
    """
    return sorted(live, key=lambda node: closing_key(node, live[node].record.prev_rank, live[node].created,
                                                     prev_ranks))


def closing_key(node: str, own_prev: int | None, created: float,
                prev_ranks: Mapping[str, int] | None) -> tuple[int, int, float]:
    """A joiner's place in `closing_order`: previous ranks first, in rank order, then newcomers by their
    join record's creation. `own_prev` is the rank its record claims, used only where the round names
    no previous ranks."""
    prev = prev_ranks.get(node) if prev_ranks else own_prev
    return (0 if prev is not None else 1, prev if prev is not None else 0, created)


def joiners_ahead(node_id: str, own_prev: int | None, first: Mapping[str, Member],
                  prev_ranks: Mapping[str, int] | None) -> list[str]:
    """Of `first`, a round's first join records by creation, the joiners that close before `node_id`, in
    closing order. `own_prev` is the previous rank our own record claims (`Join.prev_rank`). A node
    missing from `first` was created after all of them.

    Why: the closer is the first *live* joiner, so one live joiner ahead of us proves we are not it, and
    a node that knows that waits for the round to change. Finding one among the first few records costs
    one short read where the whole list of join records costs one key per node. What it cannot prove
    (no joiner ahead among `first`, or none of them alive) is judged on the whole view."""
    mine = first.get(node_id)
    own = closing_key(node_id, own_prev, mine.created if mine is not None else math.inf, prev_ranks)
    ahead = {n: closing_key(n, m.record.prev_rank, m.created, prev_ranks) for n, m in first.items()}
    return sorted((n for n, key in ahead.items() if key < own), key=ahead.__getitem__)


def _close(view: StoreView, rnd: Round, live: dict[str, Member], order: list[str],
           state: RendezvousState, s: Settings, now: Now) -> tuple[Action, RendezvousState]:
    """The closer's turn: freeze the round if it is ready, else wait (polling only while a live node
    has not joined: its join write follows its heartbeat within milliseconds, and join records are not
    watched; otherwise until the next arrival or the end of a wait)."""
    admitted = order[: s.max_nodes]
    pending = view.alive - live.keys()
    poll = POLL_FAST if pending else IDLE
    if len(admitted) < s.min_nodes:
        return Wait(poll), state
    if state.min_reached_at is None:
        state = dataclasses.replace(state, min_reached_at=now.mono)
    waited = now.mono - (state.min_reached_at or now.mono)
    expected = expected_members(rnd, view.alive, live)
    if expected:
        joined_for = now.mono - (state.joined_at if state.joined_at is not None else now.mono)
        rank0 = previous_rank0(rnd)
        if (rank0 in expected and joined_for < s.join_timeout) or joined_for < s.expect_for:
            return Wait(POLL_FAST if joined_for < EXPECT_FAST_FOR else POLL_SLOW), state
    if rnd.round == 1 and len(live) < s.initial_size:
        # Job start: the other instances are still booting; wait for them (bounded) rather than start
        # small and restart as each one arrives.
        left = s.initial_wait - (now.wall - rnd.ts)
        if left > 0:
            return Wait(POLL_FAST if pending else min(IDLE, left)), state
    elif pending and len(live) < s.max_nodes and waited < s.last_call:
        return Wait(min(POLL_FAST, s.last_call - waited)), state
    if view.round_index is None:
        return Wait(POLL_FAST), state
    if not view.settled:  # live nodes may not have re-asserted their heartbeats yet: don't leave them out
        return Wait(POLL_SLOW), state
    return Freeze(frozen(rnd, admitted, live, now.wall), view.round_index), state


def expected_members(rnd: Round, alive: frozenset[str], live: dict[str, Member]) -> set[str]:
    """Live members of the previous round that have not joined this one yet."""
    return {n for n in rnd.prev_ranks if n in alive and n not in live}


def previous_rank0(rnd: Round) -> str | None:
    return next((n for n, r in rnd.prev_ranks.items() if r == 0), None)


def frozen(rnd: Round, admitted: list[str], live: dict[str, Member], wall: float) -> Round:
    """`rnd` frozen with `admitted` in rank order; rank 0's join record names the master address."""
    master = live[admitted[0]].record
    ranks = {n: i for i, n in enumerate(admitted)}
    return dataclasses.replace(rnd, phase=Phase.FROZEN, ranks=ranks, world_size=len(ranks),
                               master_addr=master.addr, master_port=int(master.port), frozen_ts=wall)


def _frozen(view: StoreView, rnd: Round, state: RendezvousState,
            s: Settings) -> tuple[Action, RendezvousState]:
    if (info := admitted_by(rnd, s.node_id)) is not None:
        return Admitted(info), state
    # A round formed without us: our old rank now belongs to someone else, so we come back as new.
    state = dataclasses.replace(state, prev_rank=None)
    if not any(n in view.alive for n in rnd.ranks):  # nobody else will open the next round
        if not view.settled:  # every heartbeat may have expired in an outage: its members re-assert
            return Wait(POLL_SLOW), state
        return StartNextRound("all members of the previous round lost"), state
    if state.waiting_reported:
        return Wait(IDLE), state
    return Wait(IDLE, waiting_for_world=len(rnd.ranks)), dataclasses.replace(state, waiting_reported=True)


def opening_round(last: Round | None, wall: float) -> Round:
    """The round a node opens when etcd holds none: round 1 at the job's start; after the store was wiped
    (this node saw round `last`), the one after it, with `last`'s restarts and members expected."""
    if last is None or last.round is None:
        return Round(round=1, phase=Phase.JOINING, ts=wall, cause="job start")
    prev = last.ranks if last.phase is Phase.FROZEN else last.prev_ranks
    return Round(round=last.round + 1, phase=Phase.JOINING, ts=wall, restarts=last.restarts,
                 cause="store rebuilt: etcd held no round", prev_ranks=dict(prev))


def next_round(current: Round, cause: str, failure: bool, max_restarts: int, wall: float,
               leaving: str = "") -> Round | EndJob:
    """The round that replaces `current` (joining), or the job's end if a failure exhausts max_restarts.

    Its `prev_ranks` are `current`'s members (or, if it never froze, the members it expected), less
    `leaving`, the node that opens it to leave: nobody waits for a node on its way out.
    """
    restarts = current.restarts + (1 if failure else 0)
    if failure and restarts > max_restarts:
        return EndJob("failed", f"{cause}; max_restarts={max_restarts} exhausted", current.round)
    prev = current.ranks if current.phase is Phase.FROZEN else current.prev_ranks
    return Round(round=(current.round or 0) + 1, phase=Phase.JOINING, ts=wall, restarts=restarts,
                 cause=cause, save_now=None, prev_ranks={n: r for n, r in prev.items() if n != leaving})
