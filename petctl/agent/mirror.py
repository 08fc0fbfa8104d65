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

Uploads run on one background thread every `interval` seconds and once more at exit; a failing upload is
retried next time (nothing is dropped until it is stored) and never disturbs training; failures are
counted and reported once when they start and once when they end. Stdlib + boto3 (imported lazily,
s3:// only); no torch.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from petctl.core.mirrorchunks import chunk_name

MAX_CHUNK_BYTES = 8 * 1024 * 1024  # one PUT at most; a larger backlog goes as several chunks
MAX_PENDING_EVENTS = 20000  # events kept for upload while the store is unreachable (oldest dropped)


class ObjectWriter:
    """put(relative_key, bytes) under a file:// or s3:// prefix."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.scheme = u.scheme or "file"
        if self.scheme == "s3":
            self.bucket, self.prefix = u.netloc, u.path.lstrip("/")
            self._client: Any = None
        elif self.scheme == "file":
            self.root = Path(unquote(u.path) if u.scheme else url)
        else:
            raise ValueError(f"unsupported mirror URL {url!r} (use file:// or s3://)")

    def put(self, key: str, data: bytes, content_type: str = "application/json") -> None:
        if self.scheme == "s3":
            if self._client is None:
                import boto3

                self._client = boto3.client("s3")
            full = f"{self.prefix.rstrip('/')}/{key}" if self.prefix else key
            self._client.put_object(Bucket=self.bucket, Key=full, Body=data, ContentType=content_type)
            return
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)


class Mirror:
    def __init__(self, url: str, node_id: str, log_path: Path | None, interval: float = 10.0,
                 report: Callable[[str], None] | None = None) -> None:
        self.writer = ObjectWriter(url)
        self.url = url
        self.node_id = node_id
        self.log_path = log_path
        self.interval = interval
        self.report = report or _stderr
        self.epoch_ms = int(time.time() * 1000)  # names this process's chunks apart from a predecessor's
        self._event_seq = 0
        self._log_seq = 0
        self._pending: list[dict[str, Any]] = []
        self._appended = 0  # events ever added; _pending holds the last len(_pending) of them
        self._status: dict[str, Any] | None = None
        self._status_sent: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # the thread's flush and stop()'s final flush never overlap
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mirror", daemon=True)
        self.failures = 0  # consecutive failed flushes (0 once one succeeds)
        self.total_failures = 0
        self.dropped_events = 0

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

    def put_result(self, value: dict[str, Any]) -> None:
        """The job's final result, next to its data (`result.json`): readable after the stack is gone."""
        try:
            self.writer.put("result.json", json.dumps(value).encode())
        except Exception as exc:  # noqa: BLE001 - reported; the agent's own exit is what matters
            self.total_failures += 1
            self.report(f"mirror: could not write result.json to {self.url}: {type(exc).__name__}: {exc}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> None:
        """Upload what changed: the status if it differs from the last one sent, the new events, the new
        log bytes. Each part advances only once stored, so a failure resends exactly what is missing."""
        with self._flush_lock:
            try:
                self._flush_status()
                self._flush_events()
                self._flush_log()
            except Exception as exc:  # noqa: BLE001 - network, credentials, throttling: retried next time
                self.failures += 1
                self.total_failures += 1
                if self.failures == 1:
                    self.report(f"mirror: uploads to {self.url} failing ({type(exc).__name__}: {exc}); "
                                f"retrying every {self.interval:g}s")
                return
            if self.failures:
                self.report(f"mirror: uploads to {self.url} recovered after {self.failures} failed "
                            "attempt(s)")
                self.failures = 0
            if self.dropped_events:
                self.report(f"mirror: {self.dropped_events} event(s) were dropped while uploads failed")
                self.dropped_events = 0

    def _flush_status(self) -> None:
        with self._lock:
            status = self._status
        if status is not None and status != self._status_sent:
            self.writer.put(f"status/{self.node_id}.json", json.dumps(status).encode())
            self._status_sent = status

    def _flush_events(self) -> None:
        with self._lock:
            batch = list(self._pending)
            end = self._appended  # index after the last event in this batch
        if not batch:
            return
        body = "".join(json.dumps(e, default=str) + "\n" for e in batch).encode()
        self.writer.put(chunk_name("events", self.node_id, self.epoch_ms, self._event_seq), body,
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
            self.writer.put(key, data, "text/plain")
            self._log_seq += 1
            offset += len(data)
            _write_offset(marker, offset)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
        self.flush()


def _read_offset(marker: Path) -> int:
    try:
        return max(0, int(marker.read_text().strip() or 0))
    except (OSError, ValueError):
        return 0


def _write_offset(marker: Path, offset: int) -> None:
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(str(offset))
    os.replace(tmp, marker)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
