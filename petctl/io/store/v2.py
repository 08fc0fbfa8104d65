"""The v2 backend of `Store` (petctl/core/store.py): python-etcd over etcd 3.5's v2 API (`--enable-v2`).

Kept until etcd 3.5's end of support (about July 2027): etcd 3.6 removed the v2 API. It reuses
`petctl.io.etcd.etcd_client` (several members with failover, client certificates, no hidden urllib3
retries). python-etcd clients are not safe to share between threads (etcdclient.py), so the store keeps
one client per thread.

What v2 lacks is emulated, and the emulation is where it differs from v3:
- **leases**: v2 has none. A lease is a local object over TTL'd keys, refreshed one by one (v2lease.py):
  each refresh is a raft proposal, and it moves the key's modifiedIndex; its id means nothing to other
  clients, which see `Entry.lease == 0`.
- **watch**: a long poll (`wait=true&waitIndex=N&recursive=true`) returns one event per wait; etcd keeps
  only the last 1,000 events, and a wait that asks for an older one (error 401) raises Compacted. It runs
  on a connection of its own (v2watch.py), so `Watch.close()` can cut a poll in flight.
  A recursive `delete_dir` is one delete event whose key is the directory, not one per key.
- **revision**: the etcd index (`modifiedIndex`, `X-Etcd-Index`).
"""

from __future__ import annotations

import itertools
import math
import ssl
import threading
import weakref

import etcd

from petctl.core.store import Entry, Lease, LeaseExpired, Listing, StoreUnavailable
from petctl.io.etcd import etcd_client
from petctl.io.etcdpki import EtcdTls
from petctl.io.store.v2calls import dirpath, entry, errors, index
from petctl.io.store.v2lease import V2Lease
from petctl.io.store.v2watch import V2Watch


class V2Store:
    """`Store` over python-etcd; see the module docstring."""

    backend = "v2"
    beats_visible = True  # a keep-alive refreshes each key: its modifiedIndex moves

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
