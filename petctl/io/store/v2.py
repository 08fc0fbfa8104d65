"""The v2 backend of `Store` (petctl/core/store.py): python-etcd over etcd 3.5's v2 API (`--enable-v2`).

Kept until etcd 3.5's end of support (about July 2027): etcd 3.6 removed the v2 API. It reuses
`petctl.io.etcd.etcd_client` (several members with failover, client certificates, no hidden urllib3
retries). python-etcd clients are not safe to share between threads (etcdclient.py), so the store keeps one
client per thread.

What v2 lacks is emulated, and the emulation is where it differs from v3:
- **leases**: v2 has none. A lease is a local object over TTL'd keys, refreshed one by one (below):
  each refresh is a raft proposal, and it moves the key's modifiedIndex; its id means nothing to other
  clients, which see `Entry.lease == 0`.
- **watch**: a long poll (`wait=true&waitIndex=N&recursive=true`) returns one event per wait; etcd keeps
  only the last 1,000 events, and a wait that asks for an older one (error 401) raises Compacted. It runs
  on a connection of its own (v2watch.py), so `Watch.close()` can cut a poll in flight.
  A recursive `delete_dir` is one delete event whose key is the directory, not one per key.
- **revision**: the etcd index (`modifiedIndex`, `X-Etcd-Index`).
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import math
import re
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Protocol
from urllib.parse import quote, urlencode

import etcd

from petctl.core.endpoints import parse_endpoints
from petctl.core.store import (
    Batch,
    Compacted,
    Entry,
    Event,
    Lease,
    LeaseExpired,
    Listing,
    Liveness,
    StoreDenied,
    StoreError,
    StoreUnavailable,
)
from petctl.io.etcd import etcd_client
from petctl.io.etcdpki import EtcdTls
from petctl.io.store import store_errors


class V2Store:
    """`Store` over python-etcd; see the module docstring."""

    backend = "v2"

    def __init__(self, endpoint: str, tls: EtcdTls | None, timeout: float) -> None:
        self._endpoint = endpoint
        self._tls = tls
        self._timeout = timeout
        self._local = threading.local()
        self._clients: list[etcd.Client] = []
        self._leases: dict[int, V2Lease] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._ssl: ssl.SSLContext | None = None
        self._watches: weakref.WeakSet[V2Watch] = weakref.WeakSet()

    def client(self) -> etcd.Client:
        """This thread's python-etcd client. Raises StoreUnavailable once the store is closed."""
        client = getattr(self._local, "client", None)
        if client is None:
            with self._lock:
                if self._closed:
                    raise StoreUnavailable("store closed")
                client = etcd_client(self._endpoint, read_timeout=self._timeout, tls=self._tls)
                self._clients.append(client)
            self._local.client = client
        return client

    def forget(self, lease: V2Lease) -> None:
        with self._lock:
            self._leases.pop(lease.id, None)

    def _lease_of(self, key: str) -> int:
        with self._lock:
            return next((lid for lid, lease in self._leases.items() if lease.holds(key)), 0)

    def _attach(self, key: str, lease: Lease | None) -> None:
        """Record which of our leases `key` now lives under (none: it was written without one)."""
        with self._lock:
            leases = list(self._leases.values())
        for held in leases:
            if held is lease:
                held.attach(key)
            else:
                held.detach(key)

    def _ttl(self, lease: Lease | None) -> int | None:
        if lease is None:
            return None
        if not isinstance(lease, V2Lease) or lease.id not in self._leases:
            raise LeaseExpired(f"lease {lease.id} is not a live lease of this store")
        return lease.remaining()

    def get(self, key: str) -> Entry | None:
        with errors(f"get {key}"):
            try:
                node = self.client().read(key)
            except (etcd.EtcdKeyNotFound, etcd.EtcdNotDir):  # NotDir: a path through a key
                return None
        return None if node.dir else entry(node, self._lease_of(key))

    def list(self, directory: str) -> Listing:
        base = directory.rstrip("/") + "/"
        with errors(f"list {directory}"):
            try:
                result = self.client().read(dirpath(directory), recursive=True)
            except (etcd.EtcdKeyNotFound, etcd.EtcdNotDir) as e:
                return Listing((), index(e))
        leaves = sorted((n for n in result.leaves if not n.dir and n.key.startswith(base)),
                        key=lambda n: n.key)
        return Listing(tuple(entry(n, self._lease_of(n.key)) for n in leaves), int(result.etcd_index))

    def first_created(self, directory: str, limit: int) -> Listing:
        """A whole listing, cut to its first `limit` keys by createdIndex (v2 cannot sort or limit)."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        whole = self.list(directory)
        first = sorted(whole.entries, key=lambda e: e.create_revision)[:limit]
        return Listing(tuple(first), whole.revision)

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        """An update where the key exists, else a create: a plain v2 `set` would replace the node and
        reset its createdIndex, where v3 keeps a key's create_revision across writes."""
        ttl = self._ttl(lease)
        client = self.client()
        with errors(f"put {key}"):
            for _ in range(3):  # a key deleted or created by another writer in between: try again
                try:
                    node = client.write(key, value, ttl=ttl, prevExist=True)
                    break
                except etcd.EtcdKeyNotFound:
                    pass
                try:
                    node = client.write(key, value, ttl=ttl, prevExist=False)
                    break
                except etcd.EtcdAlreadyExist:
                    pass
            else:
                node = client.write(key, value, ttl=ttl)
        self._attach(key, lease)
        return int(node.modifiedIndex)

    def create(self, key: str, value: str, lease: Lease | None = None) -> bool:
        with errors(f"create {key}"):
            try:
                self.client().write(key, value, ttl=self._ttl(lease), prevExist=False)
            except (etcd.EtcdAlreadyExist, etcd.EtcdNotFile):
                return False
        self._attach(key, lease)
        return True

    def replace(self, key: str, value: str, mod_revision: int, lease: Lease | None = None) -> bool:
        if mod_revision <= 0:  # no key has revision 0 (v3 would compare a missing key's 0 as equal)
            return False
        with errors(f"replace {key}"):
            try:
                self.client().write(key, value, ttl=self._ttl(lease), prevIndex=mod_revision)
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound, etcd.EtcdNotFile):
                return False
        self._attach(key, lease)
        return True

    def delete(self, key: str, mod_revision: int | None = None) -> bool:
        if mod_revision is not None and mod_revision <= 0:
            return False
        params = {} if mod_revision is None else {"prevIndex": mod_revision}
        with errors(f"delete {key}"):
            try:
                self.client().delete(key, **params)
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound, etcd.EtcdNotFile):
                return False
        self._attach(key, None)
        return True

    def liveness(self, key: str, known: Liveness | None = None) -> Liveness | None:
        # a keep-alive rewrites the key (`refresh=True`): its modifiedIndex moves, which one read cannot
        # time; the watcher does (petctl/agent/liveness.py)
        found = self.get(key)
        return None if found is None else Liveness(found.mod_revision, found.lease, None)

    def expire(self, key: str, mod_revision: int) -> bool:
        # An emulated lease lives in its holder's process: deleting the key is all another node can do,
        # and the holder's next refresh finds it gone (LeaseExpired). Unlike `delete`, the key stays
        # attached to a lease of this store that holds it: that holder must find it gone too.
        if mod_revision <= 0:
            return False
        with errors(f"expire {key}"):
            try:
                self.client().delete(key, prevIndex=mod_revision)
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound, etcd.EtcdNotFile):
                return False
        return True

    def delete_dir(self, directory: str) -> int:
        """Counts the keys, then deletes the directory: not atomic (v3's is), so a key written between
        the two is deleted but not counted."""
        listing = self.list(directory)
        with errors(f"delete_dir {directory}"):
            try:
                self.client().delete(dirpath(directory), recursive=True, dir=True)
            except (etcd.EtcdKeyNotFound, etcd.EtcdNotDir):
                return 0
        for gone in listing.entries:
            self._attach(gone.key, None)
        return len(listing.entries)

    def grant(self, ttl: float) -> Lease:
        """A new emulated lease. Leases whose time ran out are dropped here (their keys expired in etcd
        with their TTLs), so a holder that rotates leases without revoking them does not grow the store."""
        lease = V2Lease(self, next(self._ids), max(1, math.ceil(ttl)))
        with self._lock:
            self._leases = {lid: held for lid, held in self._leases.items() if not held.expired()}
            self._leases[lease.id] = lease
        return lease

    def watch(self, directory: str, start_revision: int) -> V2Watch:
        return self._watch(directory, True, start_revision)

    def watch_key(self, key: str, start_revision: int) -> V2Watch:
        return self._watch(key, False, start_revision)

    def _watch(self, key: str, recursive: bool, start_revision: int) -> V2Watch:
        if self._closed:
            raise StoreUnavailable("store closed")
        watch = V2Watch(self._endpoint, self._context(), key, recursive, start_revision)
        self._watches.add(watch)
        return watch

    def _context(self) -> ssl.SSLContext | None:
        """The TLS context every watch connection uses (the CA and our certificate, loaded once)."""
        if self._tls is None:
            return None
        with self._lock:
            if self._ssl is None:
                self._ssl = self._tls.ssl_context()
            return self._ssl

    def revision(self, directory: str = "/") -> int:
        with errors(f"revision via {directory}"):
            try:
                return int(self.client().read(dirpath(directory)).etcd_index)
            except (etcd.EtcdKeyNotFound, etcd.EtcdNotDir) as e:
                return index(e)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, []
        for watch in list(self._watches):
            watch.close()
        for client in clients:
            client.http.clear()


# --- python-etcd's answers and failures as the store's.

def denied(e: etcd.EtcdException) -> bool:
    payload = e.payload if isinstance(e.payload, dict) else {}
    return isinstance(e, etcd.EtcdInsufficientPermissions) or payload.get("status") in (401, 403)


@contextlib.contextmanager
def errors(what: str) -> Iterator[None]:
    """python-etcd's failures as the store's: no permission → StoreDenied, anything else → StoreUnavailable.
    Answers etcd gives on purpose (key not found, compare failed) are handled by the callers first."""
    try:
        yield
    except StoreError:
        raise  # already the store's (Compacted, LeaseExpired): store_errors() below includes StoreError
    except etcd.EtcdException as e:
        if denied(e):
            raise StoreDenied(f"{what}: {e}") from e
        raise StoreUnavailable(f"{what}: {e}") from e
    except store_errors() as e:
        raise StoreUnavailable(f"{what}: {e}") from e


def index(e: etcd.EtcdException) -> int:
    """The etcd index an error answer carries (every v2 error body has one)."""
    payload = e.payload if isinstance(e.payload, dict) else {}
    return int(payload.get("index") or 0)


def dirpath(directory: str) -> str:
    """A directory as v2 requests name it: with its trailing slash, because a job's v2 role grants
    `/petctl/jobs/<job>/*`, which `/petctl/jobs/<job>/` matches and `/petctl/jobs/<job>` does not."""
    return directory.rstrip("/") + "/"


def entry(node, lease: int = 0) -> Entry:
    return Entry(key=node.key, value=node.value if node.value is not None else "",
                 mod_revision=int(node.modifiedIndex), create_revision=int(node.createdIndex), lease=lease)


# --- The v2 backend's emulated lease: v2 has no leases, so one is a local object over TTL'd keys.
#
# Its id is a local counter (meaningless to other clients, which see `Entry.lease == 0`). A key put under
# it gets a TTL of the lease's remaining time and is remembered; `keepalive` refreshes every such key
# (`refresh=True, prevExist=True`: one raft proposal per key, unseen by watchers, but it moves the key's
# modifiedIndex) and raises LeaseExpired when the lease's time ran out first or a key is gone, deleting
# the rest as v3 would have; `revoke` deletes them one by one.

class Holder(Protocol):
    """What a lease needs of its store: this thread's client, and to be forgotten once gone."""

    def client(self) -> etcd.Client: ...

    def forget(self, lease: V2Lease) -> None: ...


class V2Lease:
    """An emulated lease (see the section comment above): the keys written under it, and when it runs out."""

    def __init__(self, store: Holder, lease_id: int, ttl: int) -> None:
        self._store = store
        self._id = lease_id
        self._ttl = ttl
        self._expires = time.monotonic() + ttl
        self._keys: set[str] = set()
        self._gone = False
        self._lock = threading.Lock()

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> float:
        return float(self._ttl)

    def remaining(self) -> int:
        """Whole seconds left (at least 1) for a key written under it now. Raises LeaseExpired."""
        left = self._expires - time.monotonic()
        if self._gone or left <= 0:
            raise LeaseExpired(f"lease {self._id} expired")
        return max(1, math.ceil(left))

    def expired(self) -> bool:
        """Its time ran out, or it was revoked: no key is held under it any more."""
        return self._gone or self._expires <= time.monotonic()

    def attach(self, key: str) -> None:
        with self._lock:
            self._keys.add(key)

    def detach(self, key: str) -> None:
        with self._lock:
            self._keys.discard(key)

    def _held(self) -> list[str]:
        with self._lock:  # a copy: another thread may put under this lease meanwhile
            return sorted(self._keys)

    def holds(self, key: str) -> bool:
        return key in self._keys

    def keepalive(self) -> None:
        started = time.monotonic()
        try:
            self.remaining()
        except LeaseExpired:
            self.revoke()
            raise
        client = self._store.client()
        for key in self._held():
            with errors(f"keepalive of lease {self._id}"):
                try:
                    client.refresh(key, ttl=self._ttl)
                except etcd.EtcdKeyNotFound:
                    self.revoke()
                    raise LeaseExpired(f"lease {self._id} expired: {key} is gone") from None
        self._expires = started + self._ttl

    def revoke(self) -> None:
        client = self._store.client()
        for key in self._held():
            with errors(f"revoke of lease {self._id}"), contextlib.suppress(etcd.EtcdKeyNotFound):
                client.delete(key)
            self.detach(key)
        self._gone = True
        self._store.forget(self)


# --- The v2 backend's watch: a long poll (`wait=true&waitIndex=N`, `recursive=true` on a directory).
#
# One event per wait, resumed from the index after the last one returned. etcd keeps only the last 1,000
# events: a wait that asks for an older one (error 401) raises Compacted. A recursive directory delete
# is one delete event whose key is the directory, not one per key. A key named like the watched
# directory (`live/round` for a watch on `live/round`) is not under it, as on v3: its events are skipped.
#
# The poll is a plain HTTP(S) GET on a connection this watch owns, not python-etcd's: python-etcd's watch
# is a blocking urllib3 request that nothing can interrupt, and `close()` from another thread must end a
# wait in progress at once (an agent stopping must not sit out a 10 s poll). `close()` shuts the socket
# down. With several members, a poll that fails to connect or breaks moves to the next member; a v2 index
# is the same on every member, so the watch resumes where it was.

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
        self.requests = 0  # long polls sent (`Watch.requests`)

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
        self.requests += 1
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
