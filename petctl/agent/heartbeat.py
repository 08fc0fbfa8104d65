"""The node's liveness key: created on join, refreshed silently, deleted on a graceful leave.

Refreshes use etcd's `refresh=True`, which renews the TTL without notifying watchers, so a healthy job
produces no watch traffic at all. A node that stops refreshing (dead, or frozen with its sockets still
open) has its key expire after `ttl`; etcd then emits `expire` and every agent wakes within the TTL.
A node that finds its own key gone (it was frozen past the TTL) must treat itself as a new node.
Failed refreshes (etcd briefly unreachable) are retried until the TTL decides, and reported once per
outage (outage.py).
"""

from __future__ import annotations

import threading

import etcd

from petctl.agent.outage import OutageReporter
from petctl.core.keys import JobKeys
from petctl.core.records import NodeRecord


class Heartbeat:
    def __init__(self, client: etcd.Client, keys: JobKeys, record: NodeRecord, interval: float, ttl: float,
                 outage: OutageReporter) -> None:
        self.client = client
        self.key = keys.node(record.node_id)
        self.value = record.to_json()
        self.interval = interval
        self.ttl = max(1, int(round(ttl)))
        self.outage = outage
        self.lost = threading.Event()  # set when our key vanished under us
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deleted = False

    def register(self) -> None:
        """(Re)create the key; clears `lost`. Safe to call when it already exists. Raises
        etcd.EtcdException if etcd cannot be reached."""
        self.client.write(self.key, self.value, ttl=self.ttl)
        self.lost.clear()
        self._deleted = False

    def start(self) -> None:
        self.register()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.lost.is_set():
                continue
            try:
                self.client.refresh(self.key, ttl=self.ttl)
            except etcd.EtcdKeyNotFound:
                self.lost.set()
            except Exception as e:  # noqa: BLE001 - etcd unreachable (any form): retry until the TTL decides
                self.outage.failed(e)
                self._stop.wait(min(self.interval, 0.2))
            else:
                self.outage.succeeded()

    def stop(self, delete: bool) -> None:
        """Stop refreshing; `delete` = leaving (others see a `delete` event at once). Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.interval + 1)
        if delete and not self._deleted:
            self._deleted = True
            try:
                self.client.delete(self.key)
            except etcd.EtcdKeyNotFound:
                return  # expired already: the others have seen it go
            except etcd.EtcdException as e:  # the key expires by its TTL anyway
                self.outage.failed(e)
