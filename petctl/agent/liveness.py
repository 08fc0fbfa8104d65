"""A node's liveness: its own heartbeat key, and the watch on the next member that drops a silent one.

Sections: the heartbeat (this docstring); when a peer is silent (pure); the peer watch that acts on it.

The node's liveness key: written on join under a lease of `heartbeat_ttl` (petctl/core/store.py), kept
alive, re-asserted (a new lease, the key written again) if the lease was found gone, revoked on leave.

A keep-alive notifies no watcher on either backend (v2 emulates it with `refresh=True`, which renews the
key's TTL silently; v3's is not even a raft proposal), so a healthy job produces no watch traffic at all.
A node that stops refreshing (dead, or frozen with its sockets still open) is removed by the member
watching it (`PeerWatch`, below) once its key has not changed for the silence limit (1 s by default)
while the watcher's own refreshes went through; where no member watches it, its lease (and key) expires
after `ttl`. Either way etcd emits an event under `live/` and every agent wakes.

The refresher is its own thread doing nothing but the refresh: on a fixed monotonic schedule (a slow
refresh does not push the next one back; missed beats are skipped, not sent in a burst), and it records
when its latest applied refresh was sent (`last_ok`): the peer watch judges others only while its own
refreshes get through. A gap of GAP_BEATS refresh intervals or more between two applied refreshes (this
process was stalled or frozen, or etcd was out of reach; 0.5 s with the default interval) is reported once
it ends (`heartbeat.gap`), and the longest gap is kept (`longest_gap`): it is how close this node came to
being judged silent.

A node that finds its own lease gone (`LeaseExpired`: on v2, its key gone) while it kept refreshing was not
lost: etcd stalled past the TTL (every
key expired together when it resumed), or it was replaced by an empty one, or this process was frozen.
It writes the key again at once (`heartbeat.lost`, then `heartbeat.reasserted`) and tells the store health
(health.py), so membership is not judged until every live node had time to do the same. If the others
did drop this node meanwhile (it was frozen), the round has changed and the round runner rejoins.
Failed refreshes (etcd unreachable) are retried until etcd answers, counted, and reported once per outage
by the store health.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from petctl.agent.decisions import RoundInfo
from petctl.agent.health import OutageReporter, StoreHealth
from petctl.core.keys import JobKeys
from petctl.core.records import NodeRecord
from petctl.core.spec import Timeouts
from petctl.core.store import Lease, LeaseExpired, Liveness, Store
from petctl.io.eventlog import EventLog
from petctl.io.store import store_errors
from petctl.io.threads import Service

# --- heartbeat ----------------------------------------------------------------------------------------------

GAP_BEATS = 2.5  # refresh intervals between two applied refreshes that are worth an event (`heartbeat.gap`)


class Heartbeat:
    def __init__(self, kv: Store, keys: JobKeys, record: NodeRecord, interval: float, ttl: float,
                 outage: OutageReporter, store: StoreHealth | None = None,
                 events: EventLog | None = None) -> None:
        self.kv = kv
        self.lease: Lease | None = None  # the lease our key lives under (a new one at each re-assertion)
        self.key = keys.node(record.node_id)
        self.value = record.to_json()
        self.interval = interval
        self.ttl = max(1, int(round(ttl)))
        self.outage = outage
        self.store = store
        self.events = events
        self.reasserted = 0  # times our key had vanished and was written again
        self.last_ok: float | None = None  # monotonic send time of our latest refresh etcd applied
        self.longest_gap = 0.0  # the longest time between the sends of two applied refreshes
        self._service = Service("heartbeat", self._run)
        self._stop = self._service.stopping
        self._deleted = False
        self._written = 0  # the revision of our key's latest write
        self._errors: tuple[type[BaseException], ...] = ()  # store_errors(), resolved by start()
        # one (re)registration at a time, the refresher's or a view's; re-entrant, as a view's check holds it
        # across the re-assertion it triggers
        self._lock = threading.RLock()

    @property
    def revision(self) -> int | None:
        """The store revision of our key's latest write (the registration, or a re-assertion); None
        before the first. A watch opened after it misses nothing that happened since this node arrived
        (`LiveWatcher.start`)."""
        with self._lock:
            return self._written or None

    def register(self) -> None:
        """(Re)create the key under a new lease of `ttl`. Safe to call when it already exists. Raises
        one of `store_errors()` if etcd cannot be reached."""
        with self._lock:
            sent = time.monotonic()
            lease = self.kv.grant(self.ttl)
            self._written = self.kv.put(self.key, self.value, lease)
            old, self.lease = self.lease, lease
            self._applied(sent)
            self._deleted = False
            if old is not None:  # our key moved to the new lease: the old one holds nothing of ours now
                try:
                    old.revoke()
                except store_errors():
                    pass  # it expires by its TTL anyway

    def start(self) -> None:
        # resolved here, not in the thread: any import it needs must not delay the first keep-alive past
        # a short interval's gap (`heartbeat.gap`); python-etcd once did (about 60 ms), before v3 stopped
        # loading it (io/store/__init__.py, `store_errors`)
        self._errors = store_errors()
        self.register()
        self._service.start()

    def _run(self) -> None:
        errors = self._errors
        due = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            t0 = time.monotonic()
            due += self.interval
            if due < t0:  # late by more than a beat (a stall of this process): skip, don't burst
                due = t0 + self.interval
            lease = self.lease
            try:
                if lease is None:
                    raise LeaseExpired("no lease yet")
                lease.keepalive()
            except LeaseExpired:
                if lease is self.lease:  # else a view's re-assertion replaced it meanwhile (missing_from)
                    self._reassert(errors)
            except errors as e:  # etcd unreachable (any form): retry until it answers
                self.outage.failed(e)
                due = min(due, time.monotonic() + min(self.interval, 0.2))
            else:
                self._applied(t0)
                self.outage.succeeded(time.monotonic() - t0)

    def _applied(self, sent: float) -> None:
        """A refresh (or write) sent at `sent` was applied: note it, and report a long gap before it."""
        gap = None if self.last_ok is None else sent - self.last_ok
        self.last_ok = sent
        if gap is not None and gap > self.longest_gap:
            self.longest_gap = gap
        if gap is not None and gap >= GAP_BEATS * self.interval and self.events is not None:
            self.events.emit("heartbeat.gap", seconds=round(gap, 3))

    def missing_from(self, revision: int) -> None:
        """A view of `live/` read at `revision` lacks our key. On v3 a keep-alive notices only its lease
        gone, not its key deleted under a live lease (a recursive delete of `live/nodes`, an operator's
        `etcdctl del`), so whoever reads a view tells the heartbeat, which writes the key again as after
        a lost lease. Nothing when the view predates our latest write, or once we stopped or left."""
        with self._lock:
            if self._stop.is_set() or self._deleted or not self._written or revision < self._written:
                return
            self._reassert(store_errors())

    def _reassert(self, errors: tuple[type[BaseException], ...]) -> None:
        """Our key vanished while we kept refreshing it: say so, then write it again."""
        if self.store is not None:
            self.store.own_key_missing()
        if self.events is not None:
            self.events.emit("heartbeat.lost", reasserting=True)
        try:
            self.register()
        except errors as e:
            self.outage.failed(e)
            return
        self.reasserted += 1
        self.outage.succeeded()
        if self.events is not None:
            self.events.emit("heartbeat.reasserted", times=self.reasserted)

    @property
    def deleted(self) -> bool:
        """Our key was deleted (a leave, the job's end): this node is out of the job."""
        return self._deleted

    def stop(self, delete: bool) -> None:
        """Stop refreshing; `delete` = leaving (others see a `delete` event at once). Idempotent."""
        if not self._service.stop(timeout=2 * self.interval + 6) and self.events is not None:
            self.events.emit("heartbeat.lingered")
        if delete and not self._deleted:
            self._deleted = True
            if self.lease is None:
                return
            try:
                self.lease.revoke()  # our key goes with it (a lease already gone is no error)
            except store_errors() as e:  # the key expires by its TTL anyway
                self.outage.failed(e)


# --- silence (pure) -----------------------------------------------------------------------------------------
# When a peer's heartbeat has gone silent, as pure functions: the peer watch (below) acts on them.
#
# etcd v2 TTLs are whole seconds and etcd 3.5 removes expired keys only on its periodic sync (every 500 ms):
# a 1 s TTL expires 1.0 to 1.5 s after the last refresh (measured), so expiry alone cannot drop a frozen
# host within 1.5 s, and a shorter absolute deadline would drop every node together whenever etcd itself
# stalls. So each member of a running round watches the next member in rank order (the last watches the
# first) and judges it by *relative* silence, on its own monotonic clock:
#
# - A refresh changes the key's `modifiedIndex`. The watcher reads the key every `poll` seconds and notes
#   when it first saw the current index (`since`, taken after that read returned).
# - The peer is silent once a read *sent* at least `limit` seconds after `since` still shows that index,
#   and our own heartbeat got a refresh through that was sent at least one interval after `since`: etcd
#   applied ours while the peer's, due as often, never came. An etcd that stalls delays both (no verdict);
#   a watcher that is itself starved has no fresh refresh of its own (no verdict); a late read only
#   shortens the span it can prove. While the store is not settled (health.py) nothing is judged and
#   the clock starts again.
#
# On v3 a keep-alive changes no key (its mod_revision stays: that is what makes it cheap, no raft
# proposal and no watcher woken), so the key's revision says nothing of its holder. The lease does: etcd
# answers LeaseTimeToLive with the lease's remaining time truncated to whole seconds, so a lease kept
# alive reads its granted TTL - 1 and one left alone for a whole second reads one less from that moment
# on (`Store.liveness`, petctl/io/store/v3.py). The store measures the silence itself (`Reading.quiet`,
# a lower bound in whole seconds, on the store's clock): no clock of the watcher's starts, and the peer
# is silent once `quiet` reaches the limit while our own keep-alive, sent at least one interval after
# the peer's last one can have landed, went through. The limit is thus met in whole seconds on v3 (1 s by
# default: detection 1.0 s + one poll after the last keep-alive). The drop revokes the peer's lease
# (`Store.expire`): its key goes, and its next keep-alive raises LeaseExpired, as after an expiry. A
# new etcd leader renews every lease on taking over (etcd's lessor "promote"): a peer frozen across an
# election reads fresh again for a while, which delays a verdict but never makes a false one.
#
# Detection after a freeze is at most `limit` + 2 polls (+ the removal and the others' wake-up), about
# 1.2 s with the defaults; an absent key (expired, deleted, never written) is no verdict: etcd's TTL remains
# the backstop where no watcher runs (between rounds, two neighbours lost at once).

MIN_MISSES = 4  # a peer is never judged silent before it missed this many refreshes
POLLS_PER_LIMIT = 10  # the watcher reads its peer's key this many times per silence limit


def silence_limit(t: Timeouts) -> float:
    """Seconds of silence after which the watcher drops its peer: `peer_silence`, but never fewer than
    MIN_MISSES refresh intervals (a longer `heartbeat_interval`, as on AWS, stretches it)."""
    return max(t.peer_silence, MIN_MISSES * t.heartbeat_interval)


def watching_enabled(t: Timeouts) -> bool:
    """Whether peers watch each other at all: not when etcd's own expiry (the TTL) is as fast."""
    return silence_limit(t) < t.heartbeat_ttl


def poll_period(limit: float) -> float:
    return limit / POLLS_PER_LIMIT


def successor(ranks: Mapping[str, int], node_id: str) -> str | None:
    """The member `node_id` watches: the next rank of the round, the last watching the first; None when
    it is alone (or not a member)."""
    order = sorted(ranks, key=lambda n: ranks[n])
    if node_id not in ranks or len(order) < 2:
        return None
    return order[(order.index(node_id) + 1) % len(order)]


@dataclass(frozen=True)
class Reading:
    """One read of the peer's heartbeat key, with what the watcher knew when it sent it."""

    node: str
    index: int | None  # the key's modifiedIndex; None: no key (expired, deleted, not written yet)
    sent: float  # monotonic, just before the read was sent
    received: float  # monotonic, just after its answer arrived
    # When our own latest applied refresh was sent (monotonic). Taken before this read was sent, so etcd
    # had applied that refresh before it answered the read. None: none went through yet.
    own_refresh_sent: float | None
    settled: bool  # StoreHealth.settled(): may membership be judged from etcd now?
    # v3: whole seconds the store has seen no keep-alive for the peer's lease, a lower bound measured
    # by the store (`Liveness.quiet`); None on v2, where the watcher times an unchanged index instead
    quiet: float | None = None


@dataclass(frozen=True)
class Observation:
    """The peer's index as first seen, and when (monotonic, after the read that showed it returned)."""

    node: str
    index: int
    since: float


def observe(seen: Observation | None, r: Reading, limit: float,
            interval: float) -> tuple[Observation | None, float | None]:
    """What to remember, and how long the peer has provably been silent when that is `limit` or more
    (else None). See the module docstring for why each condition is there."""
    if not r.settled or r.index is None:
        return None, None
    if r.quiet is not None:  # measured by the store: no clock of ours to start
        # the peer's last keep-alive landed by (answer - quiet) at the latest; ours, sent an interval after
        # that, went through
        ours_went_through = (r.own_refresh_sent is not None
                             and r.own_refresh_sent >= r.received - r.quiet + interval)
        return Observation(r.node, r.index, r.received), (
            r.quiet if r.quiet >= limit and ours_went_through else None)
    if seen is None or seen.node != r.node or seen.index != r.index:
        return Observation(r.node, r.index, r.received), None
    silent = r.sent - seen.since
    ours_went_through = r.own_refresh_sent is not None and r.own_refresh_sent >= seen.since + interval
    if silent >= limit and ours_went_through:
        return seen, silent
    return seen, None


# --- the peer watch -----------------------------------------------------------------------------------------
# The watch on the next member of the running round: a frozen or cut-off host is dropped in about 1.2 s.
#
# The silence rules above decide (and say why relative silence, not a shorter TTL); this thread reads and
# acts. While a round runs, it reads the peer's heartbeat key (`Store.liveness`) every `poll` seconds. Once
# the peer is silent it ends the peer's hold (`Store.expire`, on the index it saw). On v2 that is a
# compare-and-delete: a refresh that lands meanwhile changes the index and the delete fails, so a peer
# that is alive after all is never removed. On v3 it revokes the peer's lease: the store itself measured
# a whole second with no keep-alive from it. The removal wakes
# every agent's `live/` watch exactly as an expiry would, so what follows is the usual path: a view
# without the peer, `membership.lost`, the next round. The peer, if it thaws, finds its key gone
# (`heartbeat.lost`), writes it again and rejoins, as after an expiry.
#
# Reads go through the agent's `StoreHealth` like every etcd call of the agent: a failure is counted
# (`NodeStatus.failures["peers"]`) and reported once per outage, and no verdict is taken until the store
# has settled again.

JOIN_TIMEOUT = 2.0  # stop() waits at most this long for the thread (plus one read's timeout)
RETRY_PAUSE = 0.5  # after a failed read: no verdict comes before the store settles again anyway


class PeerWatch:
    def __init__(self, kv: Store, keys: JobKeys, node_id: str, heartbeat: Heartbeat,
                 store: StoreHealth, outage: OutageReporter, events: EventLog, limit: float,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.kv = kv
        self.keys = keys
        self.node_id = node_id
        self.heartbeat = heartbeat
        self.store = store
        self.outage = outage
        self.events = events
        self.limit = limit
        self.poll = poll_period(limit)
        self.wake = wake  # our own round loop looks at once (its live/ watch would wake it anyway)
        self.dropped = 0  # peers this node removed
        self._lock = threading.Lock()
        self._target: tuple[int, str] | None = None  # (round, the member we watch)
        self._known: tuple[str, Liveness] | None = None  # the watched peer's last Store.liveness answer
        self._service = Service("peer-watch", self._run)
        self._stop = self._service.stopping

    def watch(self, info: RoundInfo) -> None:
        """Watch our successor in the round `info` describes (nobody when we are alone)."""
        peer = successor(info.ranks, self.node_id)
        with self._lock:
            self._target = (info.round, peer) if peer is not None else None

    def clear(self) -> None:
        """Our round is over: watch nobody until the next one runs."""
        with self._lock:
            self._target = None

    def start(self) -> None:
        self._service.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (bounded by one read's timeout). Idempotent."""
        if not self._service.stop(timeout=JOIN_TIMEOUT + self.poll):
            self.events.emit("peer_watch.lingered")

    def _run(self) -> None:
        seen: Observation | None = None
        watched: tuple[int, str] | None = None
        errors = store_errors()
        while not self._stop.wait(self.poll):
            with self._lock:
                target = self._target
            if target != watched:  # a new round (even with the same peer): its own clock
                seen, watched, self._known = None, target, None
            if target is None:
                continue
            try:
                reading = self._read(target[1])
            except errors as e:  # etcd unreachable or stalled: counted; judged again once settled
                self.outage.failed(e)
                seen, self._known = None, None
                self._stop.wait(RETRY_PAUSE)
                continue
            self.outage.succeeded(reading.received - reading.sent)
            seen, silent_for = observe(seen, reading, self.limit, self.heartbeat.interval)
            if silent_for is not None and seen is not None:
                self._drop(target[0], seen, silent_for)
                seen, self._known = None, None

    def _read(self, peer: str) -> Reading:
        """One read of the peer's key. Raises one of `store_errors()`."""
        own = self.heartbeat.last_ok  # before the read: etcd applied it before answering (see `observe`)
        sent = time.monotonic()
        known = self._known[1] if self._known is not None and self._known[0] == peer else None
        found = self.kv.liveness(self.keys.node(peer), known)  # v3: one request once the lease is known
        self._known = (peer, found) if found is not None else None
        return Reading(node=peer, index=found.mod_revision if found is not None else None, sent=sent,
                       received=time.monotonic(), own_refresh_sent=own, settled=self.store.settled(),
                       quiet=found.quiet if found is not None else None)

    def _drop(self, round_no: int, seen: Observation, silent_for: float) -> None:
        """Remove the silent peer's key, unless it was refreshed (or removed) since we read it."""
        try:
            if not self.kv.expire(self.keys.node(seen.node), seen.index):
                return  # refreshed at the last moment, or gone already: nothing to do
        except store_errors() as e:
            self.outage.failed(e)
            return
        self.dropped += 1
        self.events.emit("peer.silent", round=round_no, nodes=[seen.node], seconds=round(silent_for, 3),
                         limit=self.limit)
        self.wake()
