"""The v3 backend of `Store` (petctl/core/store.py), the default: etcd's gRPC API through etcd3aio.

Why etcd3aio and not the JSON gateway (etcd3gw): etcd's gRPC gateway refuses client certificates that
carry a CN (etcd PR #10392), and petctl authenticates every job by its certificate's CN.

etcd3aio is asyncio-only and the agent is threads and blocking calls: each store runs its client on a
`LoopThread` (aioloop.py; its own, or one shared by many stores) and every method is a blocking call
into it. How it maps the contract:
- compare-and-swap is a transaction: create compares `create_revision == 0`, replace and delete-if
  compare `mod_revision`;
- a lease is etcd's: `keepalive` sends ONE LeaseKeepAlive on a fresh stream and reads its answer (the
  agent owns the schedule; etcd3aio's background keep-alive task is not used); it is not a raft
  proposal, and TTL <= 0 in the answer is LeaseExpired;
- a call fails within `timeout` when etcd does not answer: writes are tried once (a retried
  transaction could report False for its own success), reads up to 3 times inside that same bound;
  gRPC's reconnect backoff is capped at 1 s so a restarted etcd is used again within about a second;
- TLS: the client certificate is presented on every member, and every member's server certificate is
  checked against the first member's address (petctl's server certificate lists every member's
  address: etcdpki.py), which is what a round-robin channel over several addresses needs.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from petctl.core.store import Entry, Lease, LeaseExpired, Listing, StoreUnavailable
from petctl.io.etcdpki import EtcdTls
from petctl.io.store.aioloop import LoopThread
from petctl.io.store.v3grpc import import_etcd3aio, store_error
from petctl.io.store.v3watch import V3Watch

T = TypeVar("T")
READ_ATTEMPTS = 3
RECONNECT_BACKOFF_MS = 1000  # gRPC's own is up to 120 s: a restarted etcd would sit unused that long


def _entry(kv: Any) -> Entry:
    return Entry(key=kv.key.decode(), value=kv.value.decode(), mod_revision=kv.mod_revision,
                 create_revision=kv.create_revision, lease=kv.lease)


def _prefix(directory: str) -> str:
    return directory.rstrip("/") + "/"


class V3Lease:
    """An etcd lease held by a V3Store."""

    def __init__(self, store: V3Store, lease_id: int, ttl: int) -> None:
        self._store = store
        self._id = lease_id
        self._ttl = ttl

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> float:
        return float(self._ttl)

    def keepalive(self) -> None:
        ttl = self._store.run(f"keepalive of lease {self._id}", self._store.keepalive_once(self._id))
        if ttl <= 0:
            raise LeaseExpired(f"lease {self._id} expired")

    def revoke(self) -> None:
        self._store.run(f"revoke of lease {self._id}", self._store.revoke_quietly(self._id))


class V3Store:
    """`Store` over etcd3aio; see the module docstring."""

    backend = "v3"
    beats_visible = False  # a keep-alive touches no key: peers see only the lease's expiry

    def __init__(self, members: list[tuple[str, int]], tls: EtcdTls | None, timeout: float,
                 loop: LoopThread | None = None) -> None:
        etcd3aio = import_etcd3aio()
        self._timeout = timeout
        self._own_loop = loop is None
        self._loop = loop or LoopThread()
        self._watches: weakref.WeakSet[V3Watch] = weakref.WeakSet()
        self._closed = False
        creds: dict[str, Any] = {}
        if tls is not None:
            creds = {"ca_cert": Path(tls.ca).read_bytes(), "cert_chain": Path(tls.cert).read_bytes(),
                     "cert_key": Path(tls.key).read_bytes(), "tls_server_name": members[0][0]}
        self._client = etcd3aio.Etcd3Client([f"{h}:{p}" for h, p in members], rpc_max_attempts=1, **creds)
        # the manager's channel options, read when connect() builds the channel
        self._client._manager.grpc_options += [
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)]
        try:
            self._loop.call(self._client.connect(), timeout)
        except BaseException:
            if self._own_loop:
                self._loop.close()
            raise

    def run(self, what: str, coro: Awaitable[T]) -> T:
        """Run `coro` on the loop within the timeout; its failures as the store's errors."""
        return self._loop.call(self._guarded(what, coro), self._timeout + 1.0)

    async def _guarded(self, what: str, coro: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self._timeout):
                return await coro
        except Exception as e:
            mapped = store_error(e, what)
            if mapped is None:
                raise
            raise mapped from e

    @property
    def _kv(self) -> Any:
        if self._client.kv is None:
            raise StoreUnavailable("store closed")
        return self._client.kv

    def _read(self, what: str, key: str, **kwargs: Any) -> Any:
        return self.run(what, self._kv.get(key, timeout=self._timeout, max_attempts=READ_ATTEMPTS, **kwargs))

    def get(self, key: str) -> Entry | None:
        response = self._read(f"get {key}", key)
        return _entry(response.kvs[0]) if response.kvs else None

    def list(self, directory: str) -> Listing:
        from etcd3aio.kv import SortOrder, SortTarget, prefix_range_end

        prefix = _prefix(directory)
        response = self._read(f"list {directory}", prefix, range_end=prefix_range_end(prefix),
                              sort_order=SortOrder.ASCEND, sort_target=SortTarget.KEY)
        return Listing(tuple(_entry(kv) for kv in response.kvs), response.header.revision)

    def revision(self, directory: str = "/") -> int:
        from etcd3aio.kv import prefix_range_end

        prefix = _prefix(directory)
        return self._read(f"revision via {directory}", prefix, range_end=prefix_range_end(prefix),
                          count_only=True).header.revision

    def _lease_id(self, lease: Lease | None) -> int:
        if lease is None:
            return 0
        if not isinstance(lease, V3Lease):
            raise TypeError(f"not a lease of this store: {lease!r}")
        return lease.id

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        response = self.run(f"put {key}", self._kv.put(key, value, lease=self._lease_id(lease),
                                                       timeout=self._timeout))
        return response.header.revision

    def _txn(self, what: str, compare: Any, op: Any) -> bool:
        return self.run(what, self._kv.txn([compare], [op], timeout=self._timeout)).succeeded

    @staticmethod
    def _compare(key: str, target: str, revision: int) -> Any:
        from etcd3aio._protobuf import Compare  # etcd3aio has no helper for a mod_revision compare

        field = {"CREATE": "create_revision", "MOD": "mod_revision"}[target]
        return Compare(result=Compare.EQUAL, target=getattr(Compare, target), key=key.encode(),
                       **{field: revision})

    def create(self, key: str, value: str, lease: Lease | None = None) -> bool:
        op = self._kv.txn_op_put(key, value, lease=self._lease_id(lease))
        return self._txn(f"create {key}", self._compare(key, "CREATE", 0), op)

    def replace(self, key: str, value: str, mod_revision: int, lease: Lease | None = None) -> bool:
        if mod_revision <= 0:  # a missing key's mod_revision is 0: comparing it would create the key
            return False
        op = self._kv.txn_op_put(key, value, lease=self._lease_id(lease))
        return self._txn(f"replace {key}", self._compare(key, "MOD", mod_revision), op)

    def delete(self, key: str, mod_revision: int | None = None) -> bool:
        if mod_revision is None:
            return self.run(f"delete {key}", self._kv.delete(key, timeout=self._timeout)).deleted > 0
        if mod_revision <= 0:
            return False
        compare = self._compare(key, "MOD", mod_revision)
        return self._txn(f"delete {key}", compare, self._kv.txn_op_delete(key))

    def delete_dir(self, directory: str) -> int:
        from etcd3aio.kv import prefix_range_end

        prefix = _prefix(directory)
        return self.run(f"delete_dir {directory}", self._kv.delete(prefix, range_end=prefix_range_end(prefix),
                                                                   timeout=self._timeout)).deleted

    def grant(self, ttl: float) -> Lease:
        if self._client.lease is None:
            raise StoreUnavailable("store closed")
        response = self.run("grant", self._client.lease.grant(max(1, math.ceil(ttl)), timeout=self._timeout))
        if response.error:
            raise StoreUnavailable(f"grant: {response.error}")
        return V3Lease(self, response.ID, response.TTL)

    async def keepalive_once(self, lease_id: int) -> int:
        """One LeaseKeepAlive request on a fresh stream, and its answer's TTL (<= 0: the lease is gone)."""
        if self._client.lease is None:
            raise StoreUnavailable("store closed")
        stream = self._client.lease.keep_alive(lease_id)
        try:
            async for response in stream:
                return response.TTL
        finally:
            stream.cancel()
        raise StoreUnavailable(f"keepalive of lease {lease_id}: the stream ended without an answer")

    async def revoke_quietly(self, lease_id: int) -> None:
        """LeaseRevoke; a lease already gone is not an error."""
        if self._client.lease is None:
            raise StoreUnavailable("store closed")
        try:
            await self._client.lease.revoke(lease_id, timeout=self._timeout)
        except Exception as e:
            if not isinstance(store_error(e, "revoke"), LeaseExpired):
                raise

    def watch(self, directory: str, start_revision: int) -> V3Watch:
        return self._watch(directory, True, start_revision)

    def watch_key(self, key: str, start_revision: int) -> V3Watch:
        return self._watch(key, False, start_revision)

    def _watch(self, key: str, prefix: bool, start_revision: int) -> V3Watch:
        if self._client._channel is None:
            raise StoreUnavailable("store closed")
        watch = V3Watch(self._loop, self._client._channel, key, prefix, start_revision, self._timeout)
        self._watches.add(watch)
        return watch

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            watch.close()
        try:
            self._loop.call(self._client.close(), 5.0)
        finally:
            if self._own_loop:
                self._loop.close()
