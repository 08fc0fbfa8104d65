"""The rendezvous over etcd: `live/` watched (`LiveWatcher`) and read into typed views (`LiveReader`), and the
executor that carries out each decision (`EtcdRendezvous`).

Sections: the `live/` watch; the live reader; the rendezvous executor (this docstring).

petctl's own rendezvous over etcd: barrier, rank assignment, world size in [min, max]. Reads and writes
go through the `Store` interface (petctl/core/store.py), on the job's backend, the `live/` watch included.

Why not torchrun's etcd backends: one agent failure closes their rendezvous for good, and a host that
vanishes without closing its sockets is noticed only when a collective times out. Here liveness is a TTL
key per node (see liveness.py), every round is one JSON value (`core.records.Round`) changed only by
compare-and-swap, and a round can always be replaced by the next one, so no single failure wedges the job.

This module is the executor: it reads etcd into typed views (`LiveReader`), asks `decisions.decide`
what to do, and does it. The rules (closer, last call, expected members, admission) live in decisions.py.

Store outages: a failed etcd call ends nothing. The step is retried with backoff (counted, and reported
once per outage by the agent's `StoreHealth`), and while the store is unsettled no round is frozen (see
decisions.py). A store found empty (wiped, then restarted on the same address) gets the round after the
last one this node saw (`decisions.opening_round`), so restarts and ranks carry on.

etcd requests per node per round are bounded: one join write, at most one CAS to open a round, the
closer's CAS to freeze it (and two deletes of the round before), plus reads on wake-ups. Only the closer
wakes for each arrival; the other joiners pause their membership watch (`LiveWatcher`), so what a node
pays does not grow with N. Nor do the keys its reads return: a joiner that finds a live joiner ahead of
it among the round's first join records knows it is not the closer, and reads no more (`_step`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from petctl.agent.decisions import (
    IDLE,
    Admitted,
    Ended,
    EndJob,
    Freeze,
    Join,
    Member,
    Members,
    Now,
    OpenFirstRound,
    ReadMembers,
    RendezvousState,
    RoundInfo,
    Settings,
    StartNextRound,
    StoreView,
    Wait,
    decide,
    from_round_alone,
    joiners_ahead,
    looks_for_one_ahead,
    next_round,
    opening_round,
    safety_period,
)
from petctl.agent.health import OutageReporter, StoreHealth
from petctl.agent.leases import LeaseClasses
from petctl.core.keys import JobKeys
from petctl.core.records import (
    DoneRecord,
    JobResult,
    JoinRecord,
    NodeRecord,
    Phase,
    Round,
    SaveNow,
    WireFormatError,
)
from petctl.core.store import Compacted, Event, Listing, Store, StoreError, Watch
from petctl.io.eventlog import EventLog
from petctl.io.jobresult import record_result
from petctl.io.procs import free_port
from petctl.io.store import store_errors

# --- the live/ watch ----------------------------------------------------------------------------------------
# The agent's watch on `live/`: two watches that set one flag, so the agent re-reads a fresh view.
#
# The agent never acts on a watch event itself: it re-reads a view, so a missed or coalesced event
# (history compaction, reconnects) cannot leave it with a stale view.
#
# Two threads: one on `live/round` (always on: round changes are what every node waits for) and one on the
# rest of `live/`, which a node may `pause()` while it only waits for the round to freeze. Why: at job
# start every instance's heartbeat appears in `live/nodes`; if all N agents woke for each of them, per-node
# requests would grow with N. Paused, an event costs only the closer a wake-up.
#
# Both are `Store` watches (a key watch on `live/round`, a directory watch on the rest), on the job's
# backend. `stop()` closes them, which ends a wait in progress at once on either backend (the Store's
# contract), so the threads are joined promptly. A watch asked for history the store no longer keeps
# (`Compacted`) starts again from a fresh read, as any other failure does (counted, reported once).

T = TypeVar("T")

JOIN_TIMEOUT = 2.0  # stop() waits at most this long per thread (a closed watch returns within a second)


@dataclass
class RequestStats:
    """etcd requests this agent made, by kind: the benchmark reports them per node per round. Watches
    count what each watch says it sent (`Watch.requests`), not its waits: on v3 a wait only takes what
    the stream delivered, and counting waits made a v3 agent's count grow with every event under
    `live/` (365-590 "watches" per node per round at 128 nodes, where etcd itself counted 3)."""

    reads: int = 0
    writes: int = 0
    watches: int = 0
    # Keys the reads returned: a listing of `live/` or of a round's join records (one key per node: only
    # the closer's grow with N), the first join records, a round record, a heartbeat key. Not a request
    # count, so not in `as_dict`. On v2 the first join records are cut from a whole listing in the client;
    # only what it kept is counted.
    keys_read: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"reads": self.reads, "writes": self.writes, "watches": self.watches}


MAX_KEPT_EVENTS = 10_000  # events kept for the agent to fold into its view; past it, a whole read


class LiveWatcher:
    """Watches `live/` through the Store and sets `changed` on every event there (see the section above)."""

    def __init__(self, kv: Store, prefix: str, stats: RequestStats, outage: OutageReporter,
                 poll_timeout: float = 10.0) -> None:
        self.kv = kv
        self.prefix = prefix
        self.stats = stats
        self.outage = outage
        self.poll_timeout = poll_timeout
        self.changed = threading.Event()
        self._stop = threading.Event()
        self._active = threading.Event()  # clear = the membership watch is paused
        self._active.set()
        self._resume_after: int | None = None  # resume the membership watch after this revision
        self._start_after: int | None = None  # both watches' first open is after this revision (`start`)
        self._events: list[Event] = []  # what the watches reported since the agent last took them
        self._stale = False  # a watch reopened from a fresh read: events may be missing
        self._lock = threading.Lock()
        self._open: dict[str, Watch] = {}  # each thread's watch now, so stop() can close it mid-wait
        self.round_key = round_key = f"{prefix}/round"
        self._round_seen: Event | None = None  # the round watch's newest event since it last (re)opened
        self._threads = [
            threading.Thread(target=self._run, name="round-watch", daemon=True,
                             args=(round_key, lambda rev: kv.watch_key(round_key, rev), None)),
            threading.Thread(target=self._run, args=(prefix, lambda rev: kv.watch(prefix, rev), self._active),
                             name="live-watch", daemon=True),
        ]

    def start(self, after: int | None = None, membership: bool = True) -> None:
        """Start both watches. With `after` (a revision read before anything the agent will read: its
        heartbeat's registration, `Heartbeat.revision`), each first opens from the next revision, with
        no read and no wake: every later change reaches the agent as an event, and it reads its own
        state after. Without it, each first reads the store's revision and wakes the agent for a fresh
        view. With `membership` False the membership watch starts paused, until a `resume`: an agent's
        rendezvous resumes it where it needs arrivals (the closer), and once it is admitted. Why: with the
        two reads, the wake's second step and arrivals waking joiners that had not yet paused the watch,
        a node made 10 requests to be ranked in a mass join; without them, 7 (bench/README.md, "A
        joiner's watches, from its registration"; issue 47)."""
        self._start_after = after
        if not membership:
            self._active.clear()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop both threads and wait for them (bounded: closing a watch ends its wait at once)."""
        self._stop.set()
        self._active.set()
        with self._lock:
            watches = list(self._open.values())
        for watch in watches:
            watch.close()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=JOIN_TIMEOUT)

    def pause(self) -> None:
        """Stop waking on membership events (the round watch stays on). Idempotent."""
        self._active.clear()

    def resume(self, after: int | None = None) -> None:
        """Watch membership again. With `after` (a revision the caller knows `live/` from: the freeze of
        the round it was admitted to), from the next revision on, and without a wake: every change since
        then wakes the agent as an event. Without it, from now, and the first thing it does is wake the
        agent for a fresh view (what changed while paused was not watched)."""
        if not self._active.is_set():
            with self._lock:
                self._resume_after = after
            self._active.set()

    def nudge(self) -> None:
        """Wake `wait` now, as a change would (a preemption notice arrived: act on it at once)."""
        self.changed.set()

    def wait(self, timeout: float) -> bool:
        fired = self.changed.wait(timeout)
        self.changed.clear()
        return fired

    def take(self) -> tuple[list[Event], bool]:
        """What the watches reported since the last take, in revision order, each change once (the
        round's come from both watches), and whether some may be missing (a watch reopened from a fresh
        read, or more piled up than `MAX_KEPT_EVENTS`): then only a whole read tells the state."""
        with self._lock:
            events, stale = self._events, self._stale
            self._events, self._stale = [], False
        unique = {(e.revision, e.key): e for e in events}
        return [unique[k] for k in sorted(unique)], stale

    def round_seen(self) -> Event | None:
        """The round watch's newest event (None before any, and again each time that watch reopens from a
        fresh read: a wiped store starts its revisions again, so an older event may not be older by
        revision): what a waiting joiner, woken by it, learns the round from without a read. Not consumed
        by `take`."""
        with self._lock:
            return self._round_seen

    def _resume_point(self) -> int | None:
        """The revision a resumed membership watch starts after (once), or None: from a fresh read."""
        with self._lock:
            after, self._resume_after = self._resume_after, None
        return after

    def _watching(self, key: str, watch: Watch | None) -> Watch | None:
        """Record (or, with None, close and forget) `key`'s watch; a watch opened after stop() is closed."""
        with self._lock:
            old = self._open.pop(key, None)
            if watch is not None and not self._stop.is_set():
                self._open[key] = kept = watch
                watch = None
            else:
                kept = None
        for gone in (old, watch):
            if gone is not None:
                gone.close()
        return kept

    def _run(self, key: str, open_watch: Callable[[int], Watch], gate: threading.Event | None) -> None:
        watch: Watch | None = None
        counted = 0  # of watch.requests, those already in stats
        first = self._start_after  # the first open's start (`start`), used once
        try:
            while not self._stop.is_set():
                if gate is not None and not gate.is_set():
                    # events while paused are skipped: resuming starts from a fresh read
                    watch = self._watching(key, None)
                    first = None  # a resume says where to start from, not the start
                    gate.wait(1.0)
                    continue
                try:
                    if watch is None:
                        if first is not None:
                            after, first = first, None
                        else:
                            after = self._resume_point() if gate is not None else None
                        fresh = after is None
                        if after is None:
                            self.stats.reads += 1
                            after = self.kv.revision(self.prefix)
                            self.outage.succeeded()
                        watch = self._watching(key, open_watch(after + 1))
                        counted = 0 if watch is None else watch.requests
                        self.stats.watches += counted
                        if fresh:  # what changed before it was not watched: the agent reads a fresh view
                            with self._lock:
                                self._stale = True
                                if key == self.round_key:
                                    self._round_seen = None
                            self.changed.set()
                        continue
                    try:
                        batch = watch.wait(self.poll_timeout)
                    finally:
                        self.stats.watches += watch.requests - counted
                        counted = watch.requests
                    if not batch.events:  # a quiet wait, or a frozen member: one cheap read tells them apart
                        self.stats.reads += 1
                        self.kv.revision(self.prefix)
                        self.outage.succeeded()
                        continue
                    self.outage.succeeded()
                    if key == self.round_key:  # one watch, so its events come in the store's order
                        with self._lock:
                            self._round_seen = batch.events[-1]
                    if gate is None or gate.is_set():
                        with self._lock:
                            self._events.extend(batch.events)
                            if len(self._events) > MAX_KEPT_EVENTS:
                                self._events, self._stale = [], True
                        self.changed.set()
                except Compacted:  # history we watch from is gone: start again from a fresh read
                    watch = self._watching(key, None)
                except StoreError as e:
                    if self._stop.is_set():
                        return
                    self.outage.failed(e, key=key)
                    watch = self._watching(key, None)
                    self._stop.wait(0.2)
        finally:
            self._watching(key, None)


# --- the live reader ----------------------------------------------------------------------------------------
# Reads a job's `live/` prefix and join records from etcd into typed views (decisions.py).
#
# Every value is parsed into its record (core/records.py). An unreadable heartbeat or join record is skipped,
# counted (`corrupt_records`, published in the node status) and reported once per key; an unreadable
# `live/round` is fatal (WireFormatError), because then no agent can know where the job stands.

class LiveReader:
    def __init__(self, kv: Store, keys: JobKeys, stats: RequestStats, events: EventLog) -> None:
        self.kv = kv
        self.keys = keys
        self.stats = stats
        self.events = events
        self.corrupt_records = 0  # unreadable join/heartbeat values seen (skipped)
        self._corrupt_seen: set[str] = set()

    def view(self) -> StoreView:
        """One read of `live/`. Raises WireFormatError if `live/round` is not a round record: only a bug
        or a foreign writer does that, and no agent can know what the job's state is then."""
        self.stats.reads += 1
        r = self.kv.list(self.keys.live)  # empty (a new or wiped store): no round, nobody alive
        self.stats.keys_read += len(r.entries)
        view = self.fold(StoreView(), [(e.key, e.value, e.mod_revision) for e in r.entries], r.revision,
                         strict=False)
        assert view is not None  # not strict: a key it does not know is skipped
        return view

    def fold(self, base: StoreView, changes: Iterable[tuple[str, str | None, int]], revision: int,
             strict: bool = True) -> StoreView | None:
        """`base` with `changes` applied, as of `revision`: each change is (key, value or None for a
        delete, its revision), in revision order; those at or before `base.etcd_index` are already in
        it. A listing is a fold of its leaves onto an empty view; a watch's events fold onto the view
        they follow. None for a change that names no leaf this reader knows (a directory deleted as a
        whole): only a fresh read can tell what it removed (`strict=False`, a listing's: skipped). Raises
        WireFormatError as `view` does."""
        alive, nodes = set(base.alive), dict(base.nodes)
        done = {n: set(members) for n, members in base.done.items()}
        mixed = {n: dict(failures) for n, failures in base.mixed.items()}
        rnd, index = base.round, base.round_index
        nodes_prefix, done_prefix = self.keys.nodes + "/", self.keys.live + "/done/"
        for key, value, rev in changes:
            if rev <= base.etcd_index:
                continue
            if key.startswith(nodes_prefix) and not (strict and "/" in key[len(nodes_prefix):]):
                node = key[len(nodes_prefix):]
                nodes.pop(node, None)
                if value is None:
                    alive.discard(node)
                    continue
                alive.add(node)  # the key's presence is what alive means, whatever its value
                try:
                    nodes[node] = NodeRecord.from_json(value)
                except WireFormatError as e:
                    self._corrupt(key, e)
            elif key == self.keys.round:
                rnd, index = (Round.from_json(value), rev) if value is not None else (None, None)
            elif key.startswith(done_prefix) and key.count("/", len(done_prefix)) == 1:
                round_text, node = key[len(done_prefix):].split("/", 1)
                round_no = int(round_text)
                mixed.get(round_no, {}).pop(node, None)
                if value is None:
                    done.get(round_no, set()).discard(node)
                    continue
                done.setdefault(round_no, set()).add(node)  # its presence is what done means
                try:
                    if failure := DoneRecord.from_json(value).failure:
                        mixed.setdefault(round_no, {})[node] = failure
                except WireFormatError as e:
                    self._corrupt(key, e)
            elif strict:
                return None
        return StoreView(alive=frozenset(alive), nodes=nodes, round=rnd, round_index=index,
                         done={n: frozenset(m) for n, m in done.items() if m},
                         mixed={n: f for n, f in mixed.items() if f},
                         etcd_index=max(revision, base.etcd_index))

    def round(self) -> tuple[Round | None, int | None]:
        """One read of `live/round` alone: the round and its `mod_revision`, or (None, None) where etcd
        holds none. Raises WireFormatError as `view` does."""
        self.stats.reads += 1
        entry = self.kv.get(self.keys.round)
        if entry is None:
            return None, None
        self.stats.keys_read += 1
        return Round.from_json(entry.value), entry.mod_revision

    def alive(self, node: str) -> bool:
        """One read of `node`'s heartbeat key: it is alive while the key exists."""
        self.stats.reads += 1
        found = self.kv.get(self.keys.node(node)) is not None
        self.stats.keys_read += found
        return found

    def members(self, round_no: int) -> dict[str, Member]:
        """The join records of `round_no` (unreadable ones skipped and counted)."""
        return self._members(self.kv.list(self.keys.round_members(round_no)))

    def first_members(self, round_no: int, limit: int) -> dict[str, Member]:
        """The first `limit` join records of `round_no` by creation (`Store.first_created`), unreadable
        ones skipped and counted."""
        return self._members(self.kv.first_created(self.keys.round_members(round_no), limit))

    def _members(self, listing: Listing) -> dict[str, Member]:
        self.stats.reads += 1
        self.stats.keys_read += len(listing.entries)
        out: dict[str, Member] = {}
        for leaf in listing.entries:
            node = leaf.key.rsplit("/", 1)[1]
            try:
                out[node] = Member(JoinRecord.from_json(leaf.value), leaf.create_revision)
            except WireFormatError as e:
                self._corrupt(leaf.key, e)
        return out

    def _corrupt(self, key: str, error: WireFormatError) -> None:
        self.corrupt_records += 1
        if key not in self._corrupt_seen:  # once per key: a view is read many times a second
            self._corrupt_seen.add(key)
            self.events.emit("rendezvous.corrupt_record", key=key, error=str(error))


# --- the rendezvous executor --------------------------------------------------------------------------------

JOIN_RECORD_TTL = 3600  # join records outlive any round; old round dirs are also deleted by closers
FIRST_JOINERS = 8  # join records a joiner reads to find a live joiner ahead of it (`_live_ahead`)
AHEAD_CHECKS = 3  # heartbeats it reads for that, at most, before it judges on the whole view
RETRY_MIN, RETRY_MAX = 0.2, 2.0  # backoff between rendezvous steps while etcd fails


class JobEnded(Exception):
    """The round went `final`: the job succeeded, failed or was killed."""

    def __init__(self, state: str, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


class RendezvousAborted(Exception):
    """The caller asked to stop waiting (graceful leave, or our heartbeat was lost)."""


class EtcdRendezvous:
    def __init__(self, kv: Store, leases: LeaseClasses, job: str, node_id: str, host_addr: str,
                 settings: Settings, events: EventLog, watcher: LiveWatcher, stats: RequestStats,
                 store: StoreHealth) -> None:
        self.kv = kv  # the job's keys through the Store interface (its backend: JobSpec.etcd_store)
        self.leases = leases  # join and done records live under the JOIN_RECORD_TTL class
        self.keys = JobKeys(job)
        self.job = job
        self.node_id = node_id
        self.host_addr = host_addr
        self.settings = settings
        self.events = events
        self.watcher = watcher
        self.stats = stats
        self.reader = LiveReader(kv, self.keys, stats, events)
        self.store = store
        self.outage = OutageReporter("rendezvous", events.emit, parent=store)
        self.on_result: Callable[[JobResult], None] | None = None
        # told when a view lacks our own heartbeat key, with the view's revision (Heartbeat.missing_from)
        self.on_own_key_missing: Callable[[int], None] | None = None
        self._prejoined: tuple[int, float] | None = None  # (round, monotonic time) of an early join
        self._cpu_at_start = 0.0  # process CPU seconds when the current rendezvous began
        self._admitted_at: int | None = None  # the revision of the freeze that admitted us
        self.last_round: Round | None = None  # the newest non-final round seen: rebuilt if etcd loses it

    def view(self) -> StoreView:
        """A fresh look at `live/`, `settled` or not as the store's health says. Raises one of
        `store_errors()` (the caller counts it, carries on) or WireFormatError (`LiveReader.view`)."""
        self.watcher.take()  # this read holds every change they report so far
        return self._seen(self._timed(self.reader.view))

    def _timed(self, read: Callable[..., T], *args: Any) -> T:
        """`read(*args)`, its time told to the store's health (`StoreHealth.succeeded`): an answer slower than
        its `slow` (etcd stalled meanwhile) unsettles every view for a while, as a failure does, so no
        absence seen just after it is trusted. Every read a rendezvous step starts with goes through
        here: the soak found a node that waited out a stall on the round record, then read `live/` at
        once, saw every heartbeat expired by the stall and not yet re-asserted, and opened a new round
        as if every member were lost. Raises what `read` raises."""
        t0 = time.monotonic()
        out = read(*args)
        self.store.succeeded(time.monotonic() - t0, "view")
        return out

    def view_since(self, prev: StoreView) -> StoreView:
        """`prev` with what the watches reported since folded in: no read when they report every change
        (`LiveWatcher.take`), else `view()`. Why: each whole read returns every node's key, and every
        running node takes one per event under `live/`, so a fleet of N paid N² keys per membership
        change. A `prev` never read from the store (`etcd_index` 0: the round runner's view before its
        first look) has nothing to fold onto. Raises as `view` does."""
        events, stale = self.watcher.take()
        if stale or not events or prev.etcd_index == 0:
            return self.view()
        revision = max(e.revision for e in events)
        view = self.reader.fold(prev, [(e.key, e.value, e.revision) for e in events], revision)
        if view is None:
            return self.view()
        return self._seen(view)

    def _seen(self, view: StoreView) -> StoreView:
        """What every view tells this node: the newest round (rebuilt from it if etcd loses it), its own
        heartbeat key missing, and whether the store is settled."""
        if view.round is not None and view.round.phase is not Phase.FINAL:
            self.last_round = view.round
        if self.node_id not in view.alive and self.on_own_key_missing is not None:
            self.on_own_key_missing(view.etcd_index)  # before `settled` is read: a re-assertion unsettles it
        return dataclasses.replace(view, settled=self.store.settled())

    # --- writing -----------------------------------------------------------------------------------
    def _cas_round(self, value: Round, prev_index: int) -> bool:
        self.stats.writes += 1
        return self.kv.replace(self.keys.round, value.to_json(), prev_index)

    def open_first_round(self) -> None:
        """Round 1, or after a wiped store the round after the last one we saw (one creator wins)."""
        value = opening_round(self.last_round, time.time())
        if self.create_round(value) and value.round != 1:
            self.events.emit("store.rebuilt", round=value.round, phase=value.phase.value,
                             restarts=value.restarts)

    def create_round(self, value: Round) -> bool:
        """Write `live/round` where etcd holds none (create-only); False if another node did first (the
        next view shows it)."""
        self.stats.writes += 1
        return self.kv.create(self.keys.round, value.to_json())

    def start_round(self, view: StoreView, cause: str, failure: bool = False, leaving: str = "") -> bool:
        """Replace the current round with round n+1 (joining). False if someone else moved it first.

        A worker failure counts against max_restarts; past it the job ends failed instead. `leaving` is
        this node when it opens the round on its way out (nobody waits for it then).
        """
        current = view.round
        if current is None or view.round_index is None or current.phase is Phase.FINAL:
            return False
        value = next_round(current, cause, failure, self.settings.max_restarts, time.time(), leaving)
        if isinstance(value, EndJob):
            self.end_job(value.state, value.reason, value.round)
            return True
        ok = self._cas_round(value, view.round_index)
        if ok:
            self.events.emit("rendezvous.restart", round=value.round, cause=cause, failure=failure,
                             restarts=value.restarts)
        return ok

    def set_save_now(self, view: StoreView, request: SaveNow) -> bool:
        """Put a save-now request on our running round (CAS); False if the round moved meanwhile."""
        rnd, index = view.round, view.round_index
        ours = rnd is not None and rnd.phase is Phase.FROZEN and self.node_id in rnd.ranks
        return ours and index is not None and self._cas_round(dataclasses.replace(rnd, save_now=request),
                                                              index)

    def set_handoff(self, view: StoreView, deadline: float) -> bool:
        """Put us on our running round's `handoffs`, a spot-noticed member that trains on until it hands
        off (roundjudge.handoff), reclaimed at `deadline` (CAS); False if the round moved meanwhile."""
        rnd, index = view.round, view.round_index
        ours = rnd is not None and rnd.phase is Phase.FROZEN and self.node_id in rnd.ranks
        return ours and index is not None and self._cas_round(
            dataclasses.replace(rnd, handoffs={**rnd.handoffs, self.node_id: deadline}), index)

    def mark_done(self, round_no: int, failure: str = "") -> None:
        self.stats.writes += 1
        record = DoneRecord(ts=time.time(), failure=failure)  # failure: a mixed ending's, else ""
        self.leases.put(f"{self.keys.done(round_no)}/{self.node_id}", record.to_json(), JOIN_RECORD_TTL,
                        new=True)

    def end_job(self, state: str, reason: str, round_no: int | None) -> bool:
        """Record the final result; True for the one agent whose write it was (it releases capacity)."""
        self.stats.writes += 2
        result = JobResult(state=state, reason=reason, ts=time.time(), round=round_no, job=self.job,
                           node=self.node_id)
        if not record_result(self.kv, result):
            return False
        self.stats.reads += 1  # the replaced round's restart count, carried into the final one
        self.events.emit("job.result", state=state, reason=reason, round=round_no)
        if self.on_result is not None:
            self.on_result(result)
        return True

    def join(self, round_no: int, prev_rank: int | None) -> None:
        record = JoinRecord(node_id=self.node_id, addr=self.host_addr, port=free_port(""), ts=time.time(),
                            prev_rank=prev_rank)
        self.stats.writes += 1
        self.leases.put(self.keys.round_member(round_no, self.node_id), record.to_json(), JOIN_RECORD_TTL,
                        new=True)
        self.events.emit("rendezvous.joined", round=round_no, prev_rank=prev_rank)

    def prejoin(self, round_no: int, prev_rank: int) -> None:
        """Join the round that replaced ours before our workers stop: its closer waits for us meanwhile."""
        self.join(round_no, prev_rank)
        self._prejoined = (round_no, time.monotonic())

    def _freeze(self, action: Freeze) -> None:
        if self._cas_round(action.value, action.index):
            forget_round(self.kv, self.keys, (action.value.round or 0) - 1, self.stats, self.events)

    # --- the rendezvous ----------------------------------------------------------------------------
    def next_rendezvous(self, prev_rank: int | None, should_abort: Callable[[], bool],
                        on_state: Callable[[str], None] | None = None) -> RoundInfo:
        """Block until a round that includes this node is frozen; return our place in it.

        Raises JobEnded when the job is over, RendezvousAborted when `should_abort()` says so. While etcd
        cannot be reached it waits (and retries) as long as it takes.
        """
        state = RendezvousState(started=time.monotonic(), prev_rank=prev_rank)
        self._cpu_at_start = time.process_time()
        if self._prejoined is not None:
            round_no, at = self._prejoined
            state = dataclasses.replace(state, joined_round=round_no, joined_at=at)
            if on_state:
                on_state("joining")
        self._prejoined = None
        self._admitted_at = None
        try:
            return self._run(state, should_abort, on_state or (lambda _: None))
        finally:
            self.watcher.resume(after=self._admitted_at)

    def _run(self, state: RendezvousState, should_abort: Callable[[], bool],
             on_state: Callable[[str], None]) -> RoundInfo:
        errors = store_errors()
        pause = RETRY_MIN
        while True:
            if should_abort():
                raise RendezvousAborted()
            try:
                info, state = self._step(state, on_state)
            except errors as e:  # etcd unreachable: counted, reported once per outage; retried
                self.outage.failed(e)
                self.watcher.wait(pause)
                pause = min(2 * pause, RETRY_MAX)
                continue
            self.outage.succeeded()
            pause = RETRY_MIN
            if info is not None:
                return info

    def _step(self, state: RendezvousState,
              on_state: Callable[[str], None]) -> tuple[RoundInfo | None, RendezvousState]:
        """One decision, carried out: our place once admitted, else None. Raises JobEnded, or one of
        `store_errors()` (the state passed in is then still the one to retry with).

        Every node looks at the round record first, from the event that woke it or one key
        (`_round_now`). That alone opens the first round, ends with the job, joins a new round, or
        admits the node to a frozen one (`from_round_alone`). A joiner then looks for a live joiner
        ahead of it (`_live_ahead`: a few keys); one is proof that it is not the closer, so it waits
        for the round to change. Only the closer, and a node that cannot prove it is not, reads `live/`
        whole and the round's join records, which return one key per node. Why: when each of N joiners
        read them, a mass join cost etcd and the agents N² keys, and 1000 nodes never ranked within
        the fleet bench's limits (issue 47)."""
        rnd, index = self._round_now(state.joined_round)
        if rnd is not None and rnd.phase is not Phase.FINAL:
            self.last_round = rnd
        action, state = from_round_alone(rnd, state, self.settings, Now(time.monotonic(), time.time()))
        if isinstance(action, Admitted):
            return self._complete(action.info, index, state), state
        if isinstance(action, Ended):
            raise JobEnded(action.state, action.reason)
        if isinstance(action, OpenFirstRound):
            self.open_first_round()
            return None, state
        if isinstance(action, Join):
            self.join(action.round, action.prev_rank)
            on_state("joining")
        if rnd is not None and looks_for_one_ahead(rnd, state):
            behind = self._live_ahead(rnd, state)
            if behind is not None:
                state = dataclasses.replace(state, ahead=frozenset({behind}))
                self._wait(Wait(safety_period(IDLE, 1, self.node_id), watch_membership=False), rnd, on_state)
                return None, state
        view = self.view()
        while True:  # Join and ReadMembers act on this view; every other action needs a new one
            action, state = decide(view, state, self.settings, Now(time.monotonic(), time.time()))
            if isinstance(action, ReadMembers):
                members = Members(action.round, self.reader.members(action.round), view.etcd_index)
                state = dataclasses.replace(state, members=members)
            elif isinstance(action, Join):
                self.join(action.round, action.prev_rank)
                on_state("joining")
            else:
                break
        if isinstance(action, Admitted):
            return self._complete(action.info, view.etcd_index, state), state
        if isinstance(action, Ended):
            raise JobEnded(action.state, action.reason)
        if isinstance(action, OpenFirstRound):
            self.open_first_round()
        elif isinstance(action, Freeze):
            self._freeze(action)
        elif isinstance(action, StartNextRound):
            self.start_round(view, action.cause, action.failure)
        elif isinstance(action, EndJob):
            self.end_job(action.state, action.reason, action.round)
        elif isinstance(action, Wait):
            self._wait(action, view.round, on_state, view.etcd_index)
        return None, state

    def _live_ahead(self, rnd: Round, state: RendezvousState) -> str | None:
        """A live joiner that closes `rnd` before us, or None where a few reads cannot find one. First
        the one we waited behind last (one key: still alive?), then the round's first `FIRST_JOINERS`
        join records (one read) and the heartbeats of those ahead of us, at most `AHEAD_CHECKS` of
        them. A node is alive while its heartbeat key exists, the same test a whole view makes (not
        judged while the store is unsettled: a key missing then sends us to the whole view, which
        waits for it to settle). Raises one of `store_errors()`."""
        for node in sorted(state.ahead)[:AHEAD_CHECKS]:
            if self._timed(self.reader.alive, node):
                return node
        first = self._timed(self.reader.first_members, rnd.round or 0, FIRST_JOINERS)
        ahead = [n for n in joiners_ahead(self.node_id, state.prev_rank, first, rnd.prev_ranks)
                 if n not in state.ahead]
        for node in ahead[:AHEAD_CHECKS]:
            if self._timed(self.reader.alive, node):
                return node
        return None

    def _round_now(self, joined: int | None) -> tuple[Round | None, int | None]:
        """The round record and its revision as a waiting joiner learns it: from the round watch's newest
        event when that is of the round it joined or a later one (the event that woke it carries the
        record: no request), else from one read. Why: a freeze wakes every joiner at once, and at 1000
        nodes their 1000 reads of the same key came in one burst, each answer the whole rank table.
        An older round's record (one the watch reported before this node joined round `joined`) can
        never admit it. A node that has joined no round yet (`joined` None) reads the key: the watch's
        newest event may be from before this rendezvous. Raises WireFormatError for an unreadable
        record, as `LiveReader.round` does."""
        seen = self.watcher.round_seen() if joined is not None else None
        if seen is not None and seen.value is not None:
            rnd = Round.from_json(seen.value)
            if rnd.round is not None and rnd.round >= joined:
                return rnd, seen.revision
        return self._timed(self.reader.round)

    def _complete(self, info: RoundInfo, known_at: int | None, state: RendezvousState) -> RoundInfo:
        """Admitted to `info`'s round; `live/` is watched from after `known_at` (the revision of the view
        that admitted us, or of the round's freeze when its record alone did; from now, after a fresh
        view, where it is not known)."""
        self._admitted_at = known_at
        seconds = round(time.monotonic() - state.started, 3)
        # CPU seconds of this agent process (every thread; not its workers): since its launch, and in this
        # rendezvous alone. What an agent costs per round carries over to hosts with cores of their own,
        # where its wall time on a shared bench machine does not (issue 47; bench P5 reports both).
        cpu = time.process_time()
        self.events.emit("rendezvous.complete", round=info.round, rank=info.rank, world_size=info.world_size,
                         seconds=seconds, cause=info.cause, requests=self.stats.as_dict(),
                         keys_read=self.stats.keys_read, cpu_s=round(cpu, 3),
                         rdzv_cpu_s=round(cpu - self._cpu_at_start, 3))
        return info

    def _wait(self, action: Wait, rnd: Round | None, on_state: Callable[[str], None],
              known: int | None = None) -> None:
        """Wait for a change or `action.timeout`. With `action.watch_membership` the membership watch
        runs: resumed after `known` (the revision of the view this wait was decided on: every change
        since is an event to it), or from now with a wake for a fresh view where that is not known."""
        if action.watch_membership:
            self.watcher.resume(after=known)
        else:
            self.watcher.pause()
        if action.waiting_for_world is not None and rnd is not None:
            self.events.emit("rendezvous.waiting", round=rnd.round,
                             world_size=action.waiting_for_world)
            on_state("waiting")
        self.watcher.wait(action.timeout)


def forget_round(kv: Store, keys: JobKeys, round_no: int, stats: RequestStats,
                 events: EventLog) -> None:
    """Old join and done records are no longer read; drop them so `live/` stays small. Best effort:
    a failed delete leaves records that expire with their TTL."""
    if round_no < 1:
        return
    for key in (keys.round_members(round_no), keys.done(round_no)):
        stats.writes += 1
        try:
            kv.delete_dir(key)  # nothing recorded in that round: 0 deleted, no error
        except store_errors() as e:
            events.emit("rendezvous.cleanup_failed", key=key, error=str(e))
