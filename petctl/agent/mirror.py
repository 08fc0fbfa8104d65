"""Where the agent's state, events and log go besides etcd, so they can be read without etcd.

On AWS etcd lives inside the VPC (no port open to the world), and a job's record must outlive the job;
so each agent mirrors to the job's prefix (s3://bucket/jobs/<job>/ or file://...):

    result.json                       the job's final result, written once by the agent that ended it
    status/<node_id>.json             the node state published in etcd (uploaded when it changed)
    events/<node_id>/<chunk>.jsonl    the events this agent emitted, as append-only chunks
    logs/<node_id>/<chunk>.log        the node log (agent events + worker output), as append-only chunks

Chunks (petctl/core/mirrorchunks.py) hold only what is new since the previous upload, so the bytes sent per
interval follow the new lines, not the file's size, and a versioned bucket keeps no stale copies. The
log's uploaded offset is kept next to the log (`.<log name>.mirrored`), so an agent restarted on the same
node continues where its predecessor stopped instead of sending the whole file again.

Uploads run on one background thread every `interval` seconds and once more at exit; every write (the
final result's too) goes through `flush`, one at a time, so no two threads ever write the same object or
offset file. A failing upload is retried next time (nothing is dropped until it is stored, the result
included) and never disturbs training. Failures are counted (`failures`, published in the node status)
and reported as events, once when an outage starts (`mirror.outage`) and once when it ends
(`mirror.recovered`), so an agent without access to its prefix is visible instead of silently
mirroring nothing. The bytes go through `petctl.io.objstore` (boto3 loads for s3:// only); no torch.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from petctl.core.eventlog import EventLog
from petctl.core.mirrorchunks import chunk_name
from petctl.core.records import JobResult
from petctl.io.files import atomic_write
from petctl.io.objstore import ObjectNotFound, ObjectStore, open_store

MAX_CHUNK_BYTES = 8 * 1024 * 1024  # one PUT at most; a larger backlog goes as several chunks
MAX_PENDING_EVENTS = 20000  # events kept for upload while the store is unreachable (oldest dropped)


class Mirror:
    """Mirrors one node's status, events and log under `url` (see the module docstring).

    log: where the outage events go; the agent passes its own EventLog (which forwards them to etcd and,
        through `add_event`, to this mirror). By default a log of its own on stderr that also feeds
        this mirror, so the outage is on record once uploads work again.
    store: the object store to write to (tests); default `open_store(url)`.
    """

    def __init__(self, url: str, node_id: str, log_path: Path | None, interval: float = 10.0,
                 log: EventLog | None = None, store: ObjectStore | None = None) -> None:
        self.store = store if store is not None else open_store(url)
        self.url = url
        self.node_id = node_id
        self.log_path = log_path
        self.interval = interval
        if log is None:
            log = EventLog("mirror", node_id=node_id)
            log.add_sink(self.add_event)
        self.log = log
        self.epoch_ms = int(time.time() * 1000)  # names this process's chunks apart from a predecessor's
        self._event_seq = 0
        self._log_seq = 0
        self._pending: list[dict[str, Any]] = []
        self._appended = 0  # events ever added; _pending holds the last len(_pending) of them
        self._status: dict[str, Any] | None = None
        self._status_sent: dict[str, Any] | None = None
        self._result: dict[str, Any] | None = None  # the job's result until it is stored
        self._lock = threading.Lock()  # the pending data above, shared with add_event/set_status
        self._flush_lock = threading.Lock()  # one flush at a time: the only path that writes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mirror", daemon=True)
        self.failures = 0  # failed flushes since start (published in the node status)
        self.dropped_events = 0  # events dropped over MAX_PENDING_EVENTS, not yet reported
        self._outage_failures = 0  # consecutive failed flushes (0: no outage)
        self._outage_since = 0.0

    def start(self) -> None:
        self._thread.start()

    def add_event(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(record)
            self._appended += 1
            excess = len(self._pending) - MAX_PENDING_EVENTS
            if excess > 0:
                del self._pending[:excess]
                self.dropped_events += excess

    def set_status(self, value: dict[str, Any]) -> None:
        with self._lock:
            self._status = dict(value)

    def put_result(self, value: dict[str, Any]) -> bool:
        """The job's final result, next to its data (`result.json`): readable after the stack is gone.
        Written now if the store answers, else by a later flush; True when it is stored."""
        with self._lock:
            self._result = dict(value)
        return self.flush() and self._result is None

    def read_result(self) -> JobResult | None:
        """The job's result as stored in its prefix (by whichever agent ended it), or None if it has
        none. Raises OSError when the store cannot be read, WireFormatError when the record is not one."""
        try:
            data = self.store.get_bytes("result.json")
        except ObjectNotFound:
            return None
        return JobResult.from_json(data)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - a bug in one flush must not end mirroring for the rest of the job; counted and reported as an outage
                with self._flush_lock:
                    self._failed(exc)

    def flush(self) -> bool:
        """Upload what changed: the result, the status if it differs from the last one sent, the new
        events, the new log bytes. Each part advances only once stored, so a failure resends exactly
        what is missing. Returns whether everything is stored; a failure (an OSError from the store or
        the log file) is counted and reported, never raised."""
        with self._flush_lock:
            try:
                self._flush_result()
                self._flush_status()
                self._flush_events()
                self._flush_log()
                if self._succeeded():
                    self._flush_events()  # the report of the recovery itself, while the store answers
            except OSError as exc:  # network, credentials, throttling, a full disk: retried next time
                self._failed(exc)
                return False
        return True

    def _failed(self, exc: BaseException) -> None:
        """Count a failed flush; the first of an outage is reported (caller holds the flush lock)."""
        self.failures += 1
        self._outage_failures += 1
        if self._outage_failures == 1:
            self._outage_since = time.monotonic()
            self.log.emit("mirror.outage", url=self.url, error=f"{type(exc).__name__}: {exc}"[:500],
                          retry_every=self.interval)

    def _succeeded(self) -> bool:
        """A flush stored everything: report the end of an outage, and events dropped during it (caller
        holds the flush lock). True when it reported something."""
        reported = False
        if self._outage_failures:
            self.log.emit("mirror.recovered", url=self.url, failed_attempts=self._outage_failures,
                          seconds=round(time.monotonic() - self._outage_since, 3))
            self._outage_failures = 0
            reported = True
        if self.dropped_events:
            dropped, self.dropped_events = self.dropped_events, 0
            self.log.emit("mirror.events_dropped", url=self.url, count=dropped)
            reported = True
        return reported

    def _flush_result(self) -> None:
        with self._lock:
            result = self._result
        if result is not None:
            self.store.put_bytes("result.json", json.dumps(result, default=str).encode(), "application/json")
            with self._lock:
                if self._result is result:
                    self._result = None

    def _flush_status(self) -> None:
        with self._lock:
            status = self._status
        if status is not None and status != self._status_sent:
            self.store.put_bytes(f"status/{self.node_id}.json", json.dumps(status, default=str).encode(),
                                 "application/json")
            self._status_sent = status

    def _flush_events(self) -> None:
        with self._lock:
            batch = list(self._pending)
            end = self._appended  # index after the last event in this batch
        if not batch:
            return
        body = "".join(json.dumps(e, default=str) + "\n" for e in batch).encode()
        self.store.put_bytes(chunk_name("events", self.node_id, self.epoch_ms, self._event_seq), body,
                             "application/x-ndjson")
        self._event_seq += 1
        with self._lock:
            # add_event only appends (or drops the oldest over the cap): drop what is now stored
            first = self._appended - len(self._pending)
            del self._pending[:max(0, end - first)]

    def _flush_log(self) -> None:
        if self.log_path is None or not self.log_path.exists():
            return
        marker = self.log_path.with_name(f".{self.log_path.name}.mirrored")
        offset = _read_offset(marker)
        size = self.log_path.stat().st_size
        if offset > size:  # the log was truncated or replaced: start again from its beginning
            offset = 0
        while offset < size:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                data = f.read(min(MAX_CHUNK_BYTES, size - offset))
            if not data:
                break
            key = chunk_name("logs", self.node_id, self.epoch_ms, self._log_seq)
            self.store.put_bytes(key, data, "text/plain")
            self._log_seq += 1
            offset += len(data)
            atomic_write(marker, str(offset))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
        self.flush()


def _read_offset(marker: Path) -> int:
    try:
        return max(0, int(marker.read_text().strip() or 0))
    except (OSError, ValueError):
        return 0
