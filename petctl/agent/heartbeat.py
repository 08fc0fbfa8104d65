"""The node's liveness key: created on join, refreshed silently, deleted on a graceful leave.

Refreshes use etcd's `refresh=True`, which renews the TTL without notifying watchers, so a healthy job
produces no watch traffic at all. A node that stops refreshing (dead, or frozen with its sockets still
open) has its key expire after `ttl`; etcd then emits `expire` and every agent wakes within the TTL.
A node that finds its own key gone (it was frozen past the TTL) must treat itself as a new node.
"""

from __future__ import annotations

import json
import threading
import time

import etcd

from petctl.core.keys import JobKeys


class Heartbeat:
    def __init__(self, client: etcd.Client, keys: JobKeys, node_id: str, host_addr: str, pid: int,
                 interval: float, ttl: float) -> None:
        self.client = client
        self.key = keys.node(node_id)
        self.value = json.dumps({"node_id": node_id, "host_addr": host_addr, "pid": pid})
        self.interval = interval
        self.ttl = max(1, int(round(ttl)))
        self.lost = threading.Event()  # set when our key vanished under us
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def register(self) -> None:
        """(Re)create the key; clears `lost`. Safe to call when it already exists."""
        self.client.write(self.key, self.value, ttl=self.ttl)
        self.lost.clear()

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
                self.errors = 0
            except etcd.EtcdKeyNotFound:
                self.lost.set()
            except Exception:  # etcd briefly unreachable: keep trying until the TTL decides
                self.errors += 1
                time.sleep(min(self.interval, 0.2))

    def stop(self, delete: bool) -> None:
        """Stop refreshing; `delete` = graceful leave (others see a `delete` event at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
        if delete:
            try:
                self.client.delete(self.key)
            except etcd.EtcdKeyNotFound:
                pass
            except Exception:
                pass
