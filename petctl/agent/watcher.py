"""The agent's watch on `live/`: long polls that set one flag, so the agent re-reads a fresh snapshot.

The agent never acts on a watch event itself: it re-reads a snapshot, so a missed or coalesced event
(history compaction, reconnects) cannot leave it with a stale view.

Two threads: one on `live/round` (always on: round changes are what every node waits for) and one on the
rest of `live/`, which a node may `pause()` while it only waits for the round to freeze. Why: at job
start every instance's heartbeat appears in `live/nodes`; if all N agents woke for each of them, per-node
requests would grow with N. Paused, an event costs only the closer a wake-up.

The long polls are plain HTTP(S) (etcd's v2 `?wait=true`) on connections this module owns, so `stop()`
can cut a poll that would otherwise hold its thread for `poll_timeout` and then join the threads
promptly. An https etcd gets the job's client certificate (`EtcdTls`), as every other etcd call does.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from petctl.agent.outage import OutageReporter
from petctl.io.etcd import endpoint_scheme, parse_endpoints
from petctl.io.etcdtls import EtcdTls

JOIN_TIMEOUT = 2.0  # stop() waits at most this long per thread (a cut poll returns within milliseconds)


@dataclass
class RequestStats:
    """etcd requests this agent made, by kind: the benchmark reports them per node per round."""

    reads: int = 0
    writes: int = 0
    watches: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"reads": self.reads, "writes": self.writes, "watches": self.watches}


class WatchError(Exception):
    """etcd answered a watch with something other than an event (an HTTP error, not JSON)."""


class IndexCleared(WatchError):
    """The index we watch from is older than etcd's event history: start again from a fresh read."""


class LongPoll:
    """etcd v2 GETs over one HTTP connection that another thread can cut (`cut()`).

    With several etcd members (`http://a:2379,http://b:2379,...`) a poll that fails to connect or breaks
    moves to the next member; a v2 index is the same on every member, so a watch resumes where it was."""

    def __init__(self, endpoint: str, timeout: float, tls: EtcdTls | None = None) -> None:
        self._members = parse_endpoints(endpoint)
        # An https etcd: one context (the CA and our certificate, loaded once) for every connection.
        https = tls is not None and endpoint_scheme(endpoint) == "https"
        self._context = tls.ssl_context() if https else None
        self._member = 0
        self.host, self.port = self._members[0]
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._cut = False
        self._lock = threading.Lock()

    def current_index(self, key: str) -> int:
        """etcd's index now (from a non-recursive read of `key`, O(1) even for a big directory)."""
        _, _, headers = self._get(key, {})
        try:
            return int(headers.get("X-Etcd-Index", ""))
        except ValueError as e:
            raise WatchError(f"no X-Etcd-Index on {key}") from e

    def watch(self, key: str, recursive: bool, index: int) -> int | None:
        """Block until an event at `index` or later under `key`; its modifiedIndex, or None on timeout.
        Raises IndexCleared, WatchError, OSError or http.client.HTTPException."""
        params = {"wait": "true", "waitIndex": str(index)}
        if recursive:
            params["recursive"] = "true"
        try:
            status, body, _ = self._get(key, params)
        except TimeoutError:
            return None
        if not body.strip():
            return None
        try:
            doc = json.loads(body)
        except ValueError as e:
            raise WatchError(f"watch on {key}: HTTP {status}, not JSON") from e
        if status == 200:
            return int(doc.get("node", {}).get("modifiedIndex", index))
        if status == 400 and doc.get("errorCode") == 401:
            raise IndexCleared(str(doc.get("message", "")))
        raise WatchError(f"watch on {key}: HTTP {status}: {doc.get('message', '')}")

    def _get(self, key: str, params: dict[str, str]) -> tuple[int, bytes, http.client.HTTPMessage]:
        waiting = params.get("wait") == "true"
        with self._lock:
            if self._cut:
                raise OSError("watch stopped")
            if self._conn is None:
                self._conn = (http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                                          context=self._context)
                              if self._context is not None else
                              http.client.HTTPConnection(self.host, self.port, timeout=self.timeout))
            conn = self._conn
        url = "/v2/keys" + quote(key) + (f"?{urlencode(params)}" if params else "")
        try:
            conn.request("GET", url)
            resp = conn.getresponse()
            return resp.status, resp.read(), resp.headers
        except BaseException as e:
            self._drop(conn)  # a timed-out or broken connection cannot be reused
            if not (waiting and isinstance(e, TimeoutError)):  # a quiet poll is not a failed member
                self._next_member()
            raise

    def _next_member(self) -> None:
        with self._lock:
            self._member = (self._member + 1) % len(self._members)
            self.host, self.port = self._members[self._member]

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
        conn.close()

    def cut(self) -> None:
        """Make a poll in flight return now (its socket is shut down) and refuse new ones."""
        with self._lock:
            self._cut = True
            conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed by its own thread: nothing to cut
                sock.shutdown(socket.SHUT_RDWR)


class LiveWatcher:
    """Long-polls `live/` and sets `changed` on every event there (see the module docstring)."""

    def __init__(self, endpoint: str, prefix: str, stats: RequestStats, outage: OutageReporter,
                 poll_timeout: float = 10.0, tls: EtcdTls | None = None) -> None:
        self.prefix = prefix
        self.stats = stats
        self.outage = outage
        self.changed = threading.Event()
        self._stop = threading.Event()
        self._active = threading.Event()  # clear = the membership watch is paused
        self._active.set()
        self._polls = [LongPoll(endpoint, poll_timeout, tls), LongPoll(endpoint, poll_timeout, tls)]
        self._threads = [
            threading.Thread(target=self._run, args=(f"{prefix}/round", False, None, self._polls[0]),
                             name="round-watch", daemon=True),
            threading.Thread(target=self._run, args=(prefix, True, self._active, self._polls[1]),
                             name="live-watch", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop both threads and wait for them (bounded: a cut poll returns at once)."""
        self._stop.set()
        self._active.set()
        for poll in self._polls:
            poll.cut()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=JOIN_TIMEOUT)

    def pause(self) -> None:
        """Stop waking on membership events (the round watch stays on). Idempotent."""
        self._active.clear()

    def resume(self) -> None:
        """Watch membership again; the first thing it does is wake the agent for a fresh snapshot."""
        if not self._active.is_set():
            self._active.set()

    def nudge(self) -> None:
        """Wake `wait` now, as a change would (a preemption notice arrived: act on it at once)."""
        self.changed.set()

    def wait(self, timeout: float) -> bool:
        fired = self.changed.wait(timeout)
        self.changed.clear()
        return fired

    def _run(self, key: str, recursive: bool, gate: threading.Event | None, poll: LongPoll) -> None:
        index: int | None = None
        while not self._stop.is_set():
            if gate is not None and not gate.is_set():
                index = None  # events while paused are skipped: resuming starts from a fresh read
                gate.wait(1.0)
                continue
            try:
                if index is None:
                    self.stats.reads += 1
                    index = poll.current_index(self.prefix) + 1
                    self.outage.succeeded()
                    self.changed.set()
                    continue
                self.stats.watches += 1
                modified = poll.watch(key, recursive, index)
                if modified is None:  # a quiet poll, or a frozen member: one cheap read tells them apart
                    self.stats.reads += 1
                    poll.current_index(self.prefix)
                    self.outage.succeeded()
                    continue
                self.outage.succeeded()
                index = max(index, modified + 1)
                if gate is None or gate.is_set():
                    self.changed.set()
            except IndexCleared:
                index = None
            except (WatchError, OSError, http.client.HTTPException) as e:
                if self._stop.is_set():
                    return
                self.outage.failed(e, key=key)
                index = None
                self._stop.wait(0.2)
