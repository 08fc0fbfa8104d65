"""One structured line per event.

Every component (agent, reconciler, CLI) reports what happened as a single JSON object on one line:
`{"ts": <unix seconds>, "event": "<area>.<what>", ...fields}`. Humans can grep it, `petctl events` and the
benchmark parse it back (`parse_line`), and nothing depends on log formatting elsewhere.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

Sink = Callable[[dict[str, Any]], None]
EVENT_START = '{"ts":'  # how every line `EventLog.emit` writes begins


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


def parse_line(line: str) -> dict[str, Any] | None:
    """The event on this log line, or None if the line is not an event (worker output, say).

    An event may share its line with what another stream of the same process wrote without a newline
    just before it: a progress bar (tqdm, the Hugging Face Trainer's default) redraws itself with `\r`
    and no `\n` on stderr, which the agent reads merged with stdout, so `\r 8%|...| 1/12{"ts": ...}`
    is one line there. Every event this module writes starts with `{"ts":`, so the event is read from
    there: losing those lines lost a round's first and last steps (its kept and lost steps)."""
    line = line.strip()
    if '"event"' not in line:
        return None
    if not line.startswith("{"):
        start = line.find(EVENT_START)
        if start < 0:
            return None
        line = line[start:]
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "event" in record and "ts" in record else None


def parse_lines(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        record = parse_line(line)
        if record is not None:
            yield record


def dedupe(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same event read from two copies (etcd and the mirror) counts once: same time, node, name."""
    seen: set[tuple] = set()
    out = []
    for e in events:
        key = (e.get("ts"), e.get("node"), e.get("event"))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out
