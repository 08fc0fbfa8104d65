"""Ship the agent's events into etcd (`events/`, in-order keys), off the agent's critical path.

`petctl events` reads the job's timeline from here while the job runs (and from the S3/file mirror after
etcd forgets it). Writes go through one background thread so an event emitted during a restart costs
the restart nothing; keys carry a TTL so a long-finished job does not fill etcd. An event that cannot be
written is dropped (the mirror still has it) and counted; an outage is reported once when it starts and
once when it ends (outage.py).
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Any

from petctl.agent.outage import OutageReporter

EVENT_TTL = 7 * 24 * 3600


class EtcdEventSink:
    def __init__(self, client: Any, key: str, outage: OutageReporter, ttl: int = EVENT_TTL) -> None:
        self.client = client
        self.key = key
        self.ttl = ttl
        self.outage = outage
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=10000)
        self._thread = threading.Thread(target=self._run, name="event-sink", daemon=True)
        self.dropped = 0  # events never written: a failed write, or a full queue

    def start(self) -> None:
        self._thread.start()

    def __call__(self, record: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            try:
                self.client.write(self.key, json.dumps(record, default=str), append=True, ttl=self.ttl)
            except Exception as e:  # noqa: BLE001 - counted and reported; the sink thread must outlive it
                self.dropped += 1
                self.outage.failed(e)
            else:
                self.outage.succeeded()

    def stop(self, timeout: float = 5.0) -> None:
        """Drain what is queued (bounded by `timeout`), then stop."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the thread is stuck on a dead etcd with a full queue; it is a daemon
        self._thread.join(timeout=timeout)
