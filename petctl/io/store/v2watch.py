"""The v2 backend's watch: a long poll (`wait=true&waitIndex=N`, `recursive=true` on a directory).

One event per wait, resumed from the index after the last one returned. etcd keeps only the last 1,000
events: a wait that asks for an older one (error 401) raises Compacted. A recursive directory delete
is one delete event whose key is the directory, not one per key. A key named like the watched
directory (`live/round` for a watch on `live/round`) is not under it, as on v3: its events are skipped.

The poll is a plain HTTP(S) GET on a connection this watch owns, not python-etcd's: python-etcd's watch
is a blocking urllib3 request that nothing can interrupt, and `close()` from another thread must end a
wait in progress at once (an agent stopping must not sit out a 10 s poll). `close()` shuts the socket
down. With several members, a poll that fails to connect or breaks moves to the next member; a v2 index
is the same on every member, so the watch resumes where it was.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import ssl
import threading
import time
from urllib.parse import quote, urlencode

from petctl.core.store import Batch, Compacted, Event, StoreDenied, StoreUnavailable
from petctl.io.etcd import parse_endpoints
from petctl.io.store.v2calls import dirpath

DELETES = ("delete", "expire", "compareAndDelete")
# etcd's cause for error 401: "the requested history has been cleared [oldest/asked]"
_CLEARED = re.compile(r"\[(\d+)/\d+\]")


class V2Watch:
    """A v2 long poll on a directory (or one key), resumed from the index after the last event."""

    def __init__(self, endpoint: str, context: ssl.SSLContext | None, key: str, recursive: bool,
                 start_revision: int) -> None:
        self._members = parse_endpoints(endpoint)
        self._member = 0
        self._context = context
        self._key = dirpath(key) if recursive else key
        self._recursive = recursive
        self._next = max(1, start_revision)
        self._seen = self._next - 1
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False
        self._lock = threading.Lock()

    def wait(self, timeout: float) -> Batch:
        deadline = time.monotonic() + timeout
        while True:
            batch = self._wait_once(max(0.05, deadline - time.monotonic()))
            if batch.events or time.monotonic() >= deadline:
                return batch

    def _wait_once(self, timeout: float) -> Batch:
        params = {"wait": "true", "waitIndex": str(self._next)}
        if self._recursive:
            params["recursive"] = "true"
        try:
            status, body = self._get(params, timeout)
        except TimeoutError:
            return Batch((), self._seen)
        except (OSError, http.client.HTTPException) as e:
            if self._closed:
                raise StoreUnavailable("watch closed") from None
            raise StoreUnavailable(f"watch {self._key}: {e}") from e
        if not body.strip():  # etcd ended a quiet poll itself
            return Batch((), self._seen)
        try:
            doc = json.loads(body)
        except ValueError as e:
            raise StoreUnavailable(f"watch {self._key}: HTTP {status}, not JSON") from e
        if status == 200:
            return self._event(doc)
        if doc.get("errorCode") == 401:
            found = _CLEARED.search(str(doc.get("cause", "")))
            raise Compacted(int(found.group(1)) if found else int(doc.get("index") or 0) - 999)
        error = StoreDenied if status in (401, 403) or doc.get("errorCode") == 110 else StoreUnavailable
        raise error(f"watch {self._key}: HTTP {status}: {doc.get('message', '')}")

    def _event(self, doc: dict) -> Batch:
        node = doc.get("node", {})
        revision = int(node.get("modifiedIndex", self._next))
        kind = "delete" if doc.get("action") in DELETES else "put"
        event = Event(kind, node.get("key", self._key), node.get("value") if kind == "put" else None,
                      revision)
        self._next = revision + 1
        self._seen = revision
        if self._recursive and not node.get("dir") and event.key == self._key.rstrip("/"):
            # etcd matches the key named like the directory too; v3's prefix `dir + "/"` does not
            return Batch((), revision)
        return Batch((event,), revision)

    def _get(self, params: dict[str, str], timeout: float) -> tuple[int, bytes]:
        with self._lock:
            if self._closed:
                raise StoreUnavailable("watch closed")
            if self._conn is None:
                host, port = self._members[self._member]
                self._conn = (http.client.HTTPSConnection(host, port, timeout=timeout, context=self._context)
                              if self._context is not None else
                              http.client.HTTPConnection(host, port, timeout=timeout))
            conn = self._conn
        conn.timeout = timeout
        try:
            if conn.sock is None:
                conn.connect()
            conn.sock.settimeout(timeout)
            if self._closed:  # closed while connecting: close() found no socket to cut
                raise StoreUnavailable("watch closed")
            conn.request("GET", "/v2/keys" + quote(self._key) + "?" + urlencode(params))
            resp = conn.getresponse()
            return resp.status, resp.read()
        except BaseException as e:
            self._drop(conn)  # a timed-out or broken connection cannot be reused
            if not isinstance(e, TimeoutError):  # a quiet poll is not a failed member
                with self._lock:
                    self._member = (self._member + 1) % len(self._members)
            raise

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
        conn.close()

    def close(self) -> None:
        """Refuse new waits and make one in flight return now (its socket is shut down). Idempotent."""
        with self._lock:
            self._closed = True
            conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed by its own thread: nothing to cut
                sock.shutdown(socket.SHUT_RDWR)
