"""The watch on the next member of the running round: a frozen or cut-off host is dropped in about 1.2 s.

silence.py decides (and says why relative silence, not a shorter TTL); this thread reads and acts. While
a round runs, it reads the peer's heartbeat key every `poll` seconds. Once the peer is silent, it removes
the key with a compare-and-delete on the index it saw: a refresh that lands meanwhile changes the index
and the delete fails, so a peer that is alive after all is never removed. The removal wakes every agent's
`live/` watch exactly as an expiry would, so what follows is the usual path: a snapshot without the peer,
`membership.lost`, the next round. The peer, if it thaws, finds its key gone (`heartbeat.lost`), writes
it again and rejoins, as after an expiry.

Reads go through the agent's `StoreHealth` like every etcd call of the agent: a failure is counted
(`NodeStatus.failures["peers"]`) and reported once per outage, and no verdict is taken until the store
has settled again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import etcd

from petctl.agent.heartbeat import Heartbeat
from petctl.agent.outage import OutageReporter
from petctl.agent.silence import Observation, Reading, observe, poll_period, successor
from petctl.agent.storehealth import StoreHealth
from petctl.agent.view import RoundInfo
from petctl.core.eventlog import EventLog
from petctl.core.keys import JobKeys
from petctl.io.etcd import store_errors

JOIN_TIMEOUT = 2.0  # stop() waits at most this long for the thread (plus one read's timeout)
RETRY_PAUSE = 0.5  # after a failed read: no verdict comes before the store settles again anyway


class PeerWatch:
    def __init__(self, client: etcd.Client, keys: JobKeys, node_id: str, heartbeat: Heartbeat,
                 store: StoreHealth, outage: OutageReporter, events: EventLog, limit: float,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.client = client  # its own: python-etcd clients are not shared between threads
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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (bounded by one read's timeout). Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=JOIN_TIMEOUT + self.poll)

    def _run(self) -> None:
        seen: Observation | None = None
        watched: tuple[int, str] | None = None
        errors = store_errors()
        while not self._stop.wait(self.poll):
            with self._lock:
                target = self._target
            if target != watched:  # a new round (even with the same peer): its own clock
                seen, watched = None, target
            if target is None:
                continue
            try:
                reading = self._read(target[1])
            except errors as e:  # etcd unreachable or stalled: counted; judged again once settled
                self.outage.failed(e)
                seen = None
                self._stop.wait(RETRY_PAUSE)
                continue
            self.outage.succeeded(reading.received - reading.sent)
            seen, silent_for = observe(seen, reading, self.limit, self.heartbeat.interval)
            if silent_for is not None and seen is not None:
                self._drop(target[0], seen, silent_for)
                seen = None

    def _read(self, peer: str) -> Reading:
        """One read of the peer's key. Raises one of `store_errors()`."""
        own = self.heartbeat.last_ok  # before the read: etcd applied it before answering (see silence.py)
        sent = time.monotonic()
        try:
            index: int | None = self.client.read(self.keys.node(peer)).modifiedIndex
        except etcd.EtcdKeyNotFound:
            index = None
        return Reading(node=peer, index=index, sent=sent, received=time.monotonic(),
                       own_refresh_sent=own, settled=self.store.settled())

    def _drop(self, round_no: int, seen: Observation, silent_for: float) -> None:
        """Remove the silent peer's key, unless it was refreshed (or removed) since we read it."""
        try:
            self.client.delete(self.keys.node(seen.node), prevIndex=seen.index)
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            return  # refreshed at the last moment, or gone already: nothing to do
        except store_errors() as e:
            self.outage.failed(e)
            return
        self.dropped += 1
        self.events.emit("peer.silent", round=round_no, nodes=[seen.node], seconds=round(silent_for, 3),
                         limit=self.limit)
        self.wake()
