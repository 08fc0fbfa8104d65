"""The event log's writer: one JSON line per event on a stream, forwarded to sinks (etcd, the S3 mirror).

The format, and reading it back, are `petctl.core.eventlog`'s.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

Sink = Callable[[dict[str, Any]], None]


class EventLog:
    """Writes events to a stream and forwards them to optional sinks (etcd, S3 mirror)."""

    def __init__(self, component: str, stream: IO[str] | None = None, **context: Any) -> None:
        self.component = component
        self.stream = stream if stream is not None else sys.stderr
        self.context = {k: v for k, v in context.items() if v is not None}
        self._sinks: list[Sink] = []
        self._lock = threading.Lock()
        self.sink_failures = 0  # records a sink raised on (published in the node status)

    def add_sink(self, sink: Sink) -> None:
        self._sinks.append(sink)

    def bind(self, **context: Any) -> None:
        """Add fields to every later event (for example the node's rank once it is known)."""
        self.context.update({k: v for k, v in context.items() if v is not None})

    def forward(self, record: dict[str, Any]) -> None:
        """Pass an event that is already on the log (a worker's line) to the sinks only."""
        self._to_sinks({**self.context, **record})

    def _to_sinks(self, record: dict[str, Any]) -> None:
        for sink in list(self._sinks):
            try:
                sink(record)
            except Exception:  # noqa: BLE001 a failing sink (etcd down) must never break the caller
                # Sinks count and report their own outages; this counts what escaped them.
                self.sink_failures += 1

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 6), "event": event, "component": self.component, **self.context,
                  **fields}
        line = json.dumps(record, default=str, separators=(",", ":"))
        with self._lock:
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except (ValueError, OSError):  # stream closed during shutdown: events are best effort
                pass
        self._to_sinks(record)
        return record
