"""The node's liveness key: created on join, refreshed silently, re-asserted if it vanished, deleted on leave.

Refreshes use etcd's `refresh=True`, which renews the TTL without notifying watchers, so a healthy job
produces no watch traffic at all. A node that stops refreshing (dead, or frozen with its sockets still
open) is removed by the member watching it (peerwatch.py) once its key has not changed for the silence
limit (1 s by default) while the watcher's own refreshes went through; where no member watches it, its key
expires after `ttl`. Either way etcd emits an event under `live/` and every agent wakes.

The refresher is its own thread doing nothing but the refresh: on a fixed monotonic schedule (a slow
refresh does not push the next one back; missed beats are skipped, not sent in a burst), and it records
when its latest applied refresh was sent (`last_ok`): the peer watch judges others only while its own
refreshes get through. A gap of GAP_BEATS refresh intervals or more between two applied refreshes (this
process was stalled or frozen, or etcd was out of reach; 0.5 s with the default interval) is reported once
it ends (`heartbeat.gap`), and the longest gap is kept (`longest_gap`): it is how close this node came to
being judged silent.

A node that finds its own key gone while it kept refreshing was not lost: etcd stalled past the TTL (every
key expired together when it resumed), or it was replaced by an empty one, or this process was frozen.
It writes the key again at once (`heartbeat.lost`, then `heartbeat.reasserted`) and tells the store health
(storehealth.py), so membership is not judged until every live node had time to do the same. If the others
did drop this node meanwhile (it was frozen), the round has changed and the round runner rejoins.
Failed refreshes (etcd unreachable) are retried until etcd answers, counted, and reported once per outage
by the store health.
"""

from __future__ import annotations

import threading
import time

import etcd

from petctl.agent.outage import OutageReporter
from petctl.agent.storehealth import StoreHealth
from petctl.core.eventlog import EventLog
from petctl.core.keys import JobKeys
from petctl.core.records import NodeRecord
from petctl.io.etcd import store_errors

GAP_BEATS = 2.5  # refresh intervals between two applied refreshes that are worth an event (`heartbeat.gap`)


class Heartbeat:
    def __init__(self, client: etcd.Client, keys: JobKeys, record: NodeRecord, interval: float, ttl: float,
                 outage: OutageReporter, store: StoreHealth | None = None,
                 events: EventLog | None = None) -> None:
        self.client = client
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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deleted = False

    def register(self) -> None:
        """(Re)create the key. Safe to call when it already exists. Raises one of
        `store_errors()` if etcd cannot be reached."""
        sent = time.monotonic()
        self.client.write(self.key, self.value, ttl=self.ttl)
        self._applied(sent)
        self._deleted = False

    def start(self) -> None:
        self.register()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        errors = store_errors()
        due = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            t0 = time.monotonic()
            due += self.interval
            if due < t0:  # late by more than a beat (a stall of this process): skip, don't burst
                due = t0 + self.interval
            try:
                self.client.refresh(self.key, ttl=self.ttl)
            except etcd.EtcdKeyNotFound:
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
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.interval + 6)
        if delete and not self._deleted:
            self._deleted = True
            try:
                self.client.delete(self.key)
            except etcd.EtcdKeyNotFound:
                return  # expired already: the others have seen it go
            except store_errors() as e:  # the key expires by its TTL anyway
                self.outage.failed(e)
