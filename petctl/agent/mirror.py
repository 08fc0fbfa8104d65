"""Where the agent's state, events and log go besides etcd, so they can be read without etcd.

On AWS etcd lives inside the VPC (no port open to the world), and a job's record must outlive the job;
so each agent mirrors to the job's prefix (s3://bucket/jobs/<job>/ or file://...):

    result.json              the job's final result, written once by the agent that ended it
    status/<node_id>.json    the node state published in etcd
    events/<node_id>.jsonl   every event this agent emitted (the job's timeline, for `petctl events`)
    logs/<node_id>.log       the node log (agent events + worker output), its newest MAX_LOG_BYTES

Uploads run on one background thread every `interval` seconds and once more at exit; a failing upload is
retried next time and never disturbs training. Stdlib + boto3 (imported lazily, s3:// only); no torch.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

MAX_LOG_BYTES = 4 * 1024 * 1024
MAX_EVENTS = 20000


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
    def __init__(self, url: str, node_id: str, log_path: Path | None, interval: float = 10.0) -> None:
        self.writer = ObjectWriter(url)
        self.node_id = node_id
        self.log_path = log_path
        self.interval = interval
        self._events: list[dict[str, Any]] = []
        self._status: dict[str, Any] | None = None
        self._dirty = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mirror", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def add_event(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(record)
            del self._events[:-MAX_EVENTS]
        self._dirty.set()

    def set_status(self, value: dict[str, Any]) -> None:
        with self._lock:
            self._status = dict(value)
        self._dirty.set()

    def put_result(self, value: dict[str, Any]) -> None:
        """The job's final result, next to its data (`result.json`): readable after the stack is gone."""
        try:
            self.writer.put("result.json", json.dumps(value).encode())
        except Exception:
            self.failures += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            status = self._status
            events = list(self._events)
        try:
            if status is not None:
                self.writer.put(f"status/{self.node_id}.json", json.dumps(status).encode())
            body = "".join(json.dumps(e, default=str) + "\n" for e in events)
            self.writer.put(f"events/{self.node_id}.jsonl", body.encode(), "application/x-ndjson")
            if self.log_path is not None and self.log_path.exists():
                self.writer.put(f"logs/{self.node_id}.log", _tail(self.log_path, MAX_LOG_BYTES), "text/plain")
            self.failures = 0
        except Exception:  # network, credentials, throttling: the next flush tries again
            self.failures += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
        self.flush()


def _tail(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read()
