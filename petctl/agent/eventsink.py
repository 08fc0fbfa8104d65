"""Ship the agent's events into etcd (`events/`, in-order keys), off the agent's critical path.

`petctl events` reads the job's timeline from here while the job runs (and from the S3/file mirror after
etcd forgets it). Writes go through one background thread so an event emitted during a restart costs
the restart nothing; keys carry a TTL so a long-finished job does not fill etcd.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Any

EVENT_TTL = 7 * 24 * 3600


class EtcdEventSink:
    def __init__(self, client: Any, key: str, ttl: int = EVENT_TTL) -> None:
        self.client = client
        self.key = key
        self.ttl = ttl
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=10000)
        self._thread = threading.Thread(target=self._run, name="event-sink", daemon=True)
        self.dropped = 0

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
            except Exception:
                self.dropped += 1

    def stop(self, timeout: float = 5.0) -> None:
        """Drain what is queued (bounded by `timeout`), then stop."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)
