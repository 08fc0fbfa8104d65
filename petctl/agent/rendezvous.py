"""petctl's own rendezvous over etcd v2: barrier, rank assignment, world size in [min, max].

Why not torchrun's etcd backends: one agent failure closes their rendezvous for good, and a host that
vanishes without closing its sockets is noticed only when a collective times out. Here liveness is a TTL
key per node (see heartbeat.py), every round is one JSON value (`core.records.Round`) changed only by
compare-and-swap, and a round can always be replaced by the next one, so no single failure wedges the job.

This module is the executor: it reads etcd into typed snapshots (livereader.py), asks `decisions.decide`
what to do, and does it. The rules (closer, last call, expected members, admission) live in decisions.py.

Store outages: a failed etcd call ends nothing. The step is retried with backoff (counted, and reported
once per outage by the agent's `StoreHealth`), and while the store is unsettled no round is frozen (see
decisions.py). A store found empty (wiped, then restarted on the same address) gets the round after the
last one this node saw (`decisions.opening_round`), so restarts and ranks carry on.

etcd requests per node per round are bounded: one join write, at most one CAS to open a round, the
closer's CAS to freeze it (and two deletes of the round before), plus reads on wake-ups. Only the closer
wakes for each arrival; the other joiners pause their membership watch (see watcher.py), so what a node
pays does not grow with N.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import etcd

from petctl.agent.decisions import (
    Admitted,
    Ended,
    EndJob,
    Freeze,
    Join,
    Now,
    OpenFirstRound,
    ReadMembers,
    RendezvousState,
    Settings,
    StartNextRound,
    Wait,
    decide,
    next_round,
    opening_round,
)
from petctl.agent.livereader import LiveReader
from petctl.agent.outage import OutageReporter
from petctl.agent.storehealth import StoreHealth
from petctl.agent.view import Members, RoundInfo, Snapshot
from petctl.agent.watcher import LiveWatcher, RequestStats
from petctl.core.eventlog import EventLog
from petctl.core.keys import JobKeys
from petctl.core.records import (
    DoneRecord,
    JobResult,
    JoinRecord,
    Phase,
    Preempt,
    Round,
)
from petctl.io.etcd import free_port, store_errors
from petctl.io.jobresult import record_result

JOIN_RECORD_TTL = 3600  # join records outlive any round; old round dirs are also deleted by closers
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
    def __init__(self, client: etcd.Client, job: str, node_id: str, host_addr: str, settings: Settings,
                 events: EventLog, watcher: LiveWatcher, stats: RequestStats, store: StoreHealth) -> None:
        self.client = client
        self.keys = JobKeys(job)
        self.job = job
        self.node_id = node_id
        self.host_addr = host_addr
        self.settings = settings
        self.events = events
        self.watcher = watcher
        self.stats = stats
        self.reader = LiveReader(client, self.keys, stats, events)
        self.store = store
        self.outage = OutageReporter("rendezvous", events.emit, parent=store)
        self.on_result: Callable[[JobResult], None] | None = None
        self._prejoined: tuple[int, float] | None = None  # (round, monotonic time) of an early join
        self.last_round: Round | None = None  # the newest non-final round seen: rebuilt if etcd loses it

    def snapshot(self) -> Snapshot:
        """A fresh look at `live/`, `settled` or not as the store's health says. Raises one of
        `store_errors()` (the caller counts it, carries on) or WireFormatError (livereader.py)."""
        t0 = time.monotonic()
        snap = self.reader.snapshot()
        self.store.succeeded(time.monotonic() - t0, "snapshot")
        if snap.round is not None and snap.round.phase is not Phase.FINAL:
            self.last_round = snap.round
        return dataclasses.replace(snap, settled=self.store.settled())

    # --- writing -----------------------------------------------------------------------------------
    def _cas_round(self, value: Round, prev_index: int) -> bool:
        self.stats.writes += 1
        try:
            self.client.write(self.keys.round, value.to_json(), prevIndex=prev_index)
            return True
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            return False

    def open_first_round(self) -> None:
        """Round 1, or after a wiped store the round after the last one we saw (one creator wins)."""
        value = opening_round(self.last_round, time.time())
        if self.create_round(value) and value.round != 1:
            self.events.emit("store.rebuilt", round=value.round, phase=value.phase.value,
                             restarts=value.restarts)

    def create_round(self, value: Round) -> bool:
        """Write `live/round` where etcd holds none (`prevExist=False`); False if another node did first."""
        self.stats.writes += 1
        try:
            self.client.write(self.keys.round, value.to_json(), prevExist=False)
        except etcd.EtcdAlreadyExist:
            return False  # another node wrote it first: the next snapshot shows it
        return True

    def start_round(self, snap: Snapshot, cause: str, failure: bool = False, leaving: str = "") -> bool:
        """Replace the current round with round n+1 (joining). False if someone else moved it first.

        A worker failure counts against max_restarts; past it the job ends failed instead. `leaving` is
        this node when it opens the round on its way out (nobody waits for it then).
        """
        current = snap.round
        if current is None or snap.round_index is None or current.phase is Phase.FINAL:
            return False
        value = next_round(current, cause, failure, self.settings.max_restarts, time.time(), leaving)
        if isinstance(value, EndJob):
            self.end_job(value.state, value.reason, value.round)
            return True
        ok = self._cas_round(value, snap.round_index)
        if ok:
            self.events.emit("rendezvous.restart", round=value.round, cause=cause, failure=failure,
                             restarts=value.restarts)
        return ok

    def set_preempt(self, snap: Snapshot, request: Preempt) -> bool:
        """Put a save-now request on our running round (CAS); False if the round moved meanwhile."""
        rnd, index = snap.round, snap.round_index
        ours = rnd is not None and rnd.phase is Phase.FROZEN and self.node_id in rnd.ranks
        return ours and index is not None and self._cas_round(dataclasses.replace(rnd, preempt=request),
                                                              index)

    def mark_done(self, round_no: int, failure: str = "") -> None:
        self.stats.writes += 1
        record = DoneRecord(ts=time.time(), failure=failure)  # failure: a mixed ending's, else ""
        self.client.write(f"{self.keys.done(round_no)}/{self.node_id}", record.to_json(), ttl=JOIN_RECORD_TTL)

    def end_job(self, state: str, reason: str, round_no: int | None) -> bool:
        """Record the final result; True for the one agent whose write it was (it releases capacity)."""
        self.stats.writes += 2
        result = JobResult(state=state, reason=reason, ts=time.time(), round=round_no, job=self.job,
                           node=self.node_id)
        if not record_result(self.client, result):
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
        self.client.write(self.keys.round_member(round_no, self.node_id), record.to_json(),
                          ttl=JOIN_RECORD_TTL)
        self.events.emit("rendezvous.joined", round=round_no, prev_rank=prev_rank)

    def prejoin(self, round_no: int, prev_rank: int) -> None:
        """Join the round that replaced ours before our workers stop: its closer waits for us meanwhile."""
        self.join(round_no, prev_rank)
        self._prejoined = (round_no, time.monotonic())

    def _freeze(self, action: Freeze) -> None:
        if self._cas_round(action.value, action.index):
            forget_round(self.client, self.keys, (action.value.round or 0) - 1, self.stats, self.events)

    # --- the rendezvous ----------------------------------------------------------------------------
    def next_rendezvous(self, prev_rank: int | None, should_abort: Callable[[], bool],
                        on_state: Callable[[str], None] | None = None) -> RoundInfo:
        """Block until a round that includes this node is frozen; return our place in it.

        Raises JobEnded when the job is over, RendezvousAborted when `should_abort()` says so. While etcd
        cannot be reached it waits (and retries) as long as it takes.
        """
        state = RendezvousState(started=time.monotonic(), prev_rank=prev_rank)
        if self._prejoined is not None:
            round_no, at = self._prejoined
            state = dataclasses.replace(state, joined_round=round_no, joined_at=at)
            if on_state:
                on_state("joining")
        self._prejoined = None
        try:
            return self._run(state, should_abort, on_state or (lambda _: None))
        finally:
            self.watcher.resume()

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
        """One decision on a fresh snapshot, carried out: our place once admitted, else None. Raises
        JobEnded, or one of `store_errors()` (the state passed in is then still the one to retry with)."""
        snap = self.snapshot()
        while True:  # Join and ReadMembers act on this snapshot; every other action needs a new one
            action, state = decide(snap, state, self.settings, Now(time.monotonic(), time.time()))
            if isinstance(action, ReadMembers):
                members = Members(action.round, self.reader.members(action.round), snap.etcd_index)
                state = dataclasses.replace(state, members=members)
            elif isinstance(action, Join):
                self.join(action.round, action.prev_rank)
                on_state("joining")
            else:
                break
        if isinstance(action, Admitted):
            info = action.info
            seconds = round(time.monotonic() - state.started, 3)
            self.events.emit("rendezvous.complete", round=info.round, rank=info.rank,
                             world_size=info.world_size, seconds=seconds, cause=info.cause,
                             requests=self.stats.as_dict())
            return info, state
        if isinstance(action, Ended):
            raise JobEnded(action.state, action.reason)
        if isinstance(action, OpenFirstRound):
            self.open_first_round()
        elif isinstance(action, Freeze):
            self._freeze(action)
        elif isinstance(action, StartNextRound):
            self.start_round(snap, action.cause, action.failure)
        elif isinstance(action, EndJob):
            self.end_job(action.state, action.reason, action.round)
        elif isinstance(action, Wait):
            self._wait(action, snap, on_state)
        return None, state

    def _wait(self, action: Wait, snap: Snapshot, on_state: Callable[[str], None]) -> None:
        if action.watch_membership:
            self.watcher.resume()
        else:
            self.watcher.pause()
        if action.waiting_for_world is not None and snap.round is not None:
            self.events.emit("rendezvous.waiting", round=snap.round.round,
                             world_size=action.waiting_for_world)
            on_state("waiting")
        self.watcher.wait(action.timeout)


def forget_round(client: etcd.Client, keys: JobKeys, round_no: int, stats: RequestStats,
                 events: EventLog) -> None:
    """Old join and done records are no longer read; drop them so `live/` stays small. Best effort:
    a failed delete leaves records that expire with their TTL."""
    if round_no < 1:
        return
    for key in (keys.round_members(round_no), keys.done(round_no)):
        stats.writes += 1
        try:
            client.delete(key, recursive=True)
        except etcd.EtcdKeyNotFound:
            continue  # nothing was recorded in that round
        except store_errors() as e:
            events.emit("rendezvous.cleanup_failed", key=key, error=str(e))
