"""The v3 backend of `Store` (petctl/core/store.py), the default: etcd's gRPC API through etcd3aio.

Why etcd3aio and not the JSON gateway (etcd3gw): etcd's gRPC gateway refuses client certificates that
carry a CN (etcd PR #10392), and petctl authenticates every job by its certificate's CN.

etcd3aio is asyncio-only and the agent is threads and blocking calls: each store runs its client on a
`LoopThread` (below; its own, or one shared by many stores) and every method is a blocking call
into it. How it maps the contract:
- compare-and-swap is a transaction: create compares `create_revision == 0`, replace and delete-if
  compare `mod_revision`;
- a lease is etcd's: `keepalive` sends ONE LeaseKeepAlive request and reads its answer (the agent owns
  the schedule; etcd3aio's background keep-alive task is not used); it is not a raft proposal, and
  TTL <= 0 in the answer is LeaseExpired. The requests go on one LeaseKeepAlive stream the store keeps
  open (`KeepAliveStream`), as etcd's own Go client does, not a fresh stream each: a fresh stream cost
  this client 0.81 ms of CPU per blocking `keepalive()` against 0.34 ms (2,000 keep-alives), and an
  agent sends five a second;
- a call fails within `timeout` when etcd does not answer: writes are tried once (a retried
  transaction could report False for its own success), reads up to 3 times inside that same bound;
  gRPC's reconnect backoff is capped at 1 s so a restarted etcd is used again within about a second;
- TLS: the client certificate is presented on every member, and every member's server certificate is
  checked against the first member's address (petctl's server certificate lists every member's
  address: etcdpki.py), which is what a round-robin channel over several addresses needs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import importlib.util
import math
import os
import queue
import threading
import weakref
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

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
from petctl.io import etcdname
from petctl.io.etcdpki import EtcdTls

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

    def __init__(self, members: list[tuple[str, int]], tls: EtcdTls | None, timeout: float,
                 loop: LoopThread | None = None) -> None:
        etcd3aio = import_etcd3aio()
        self._timeout = timeout
        self._own_loop = loop is None
        self._loop = loop or LoopThread()
        self._watches: weakref.WeakSet[V3Watch] = weakref.WeakSet()
        self._keepalives = KeepAliveStream()
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
        # Retried like a read: deleting a range twice leaves the same store, so a connection that failed
        # its handshake (seen under load: UNAVAILABLE, "Handshake read failed") costs a retry, not the call.
        deleting = self._kv.delete(prefix, range_end=prefix_range_end(prefix), timeout=self._timeout,
                                   max_attempts=READ_ATTEMPTS)
        return self.run(f"delete_dir {directory}", deleting).deleted

    def grant(self, ttl: float) -> Lease:
        if self._client.lease is None:
            raise StoreUnavailable("store closed")
        response = self.run("grant", self._client.lease.grant(max(1, math.ceil(ttl)), timeout=self._timeout))
        if response.error:
            raise StoreUnavailable(f"grant: {response.error}")
        return V3Lease(self, response.ID, response.TTL)

    def liveness(self, key: str, known: Liveness | None = None) -> Liveness | None:
        # A keep-alive touches no key (that is what makes it cheap), so the key's revision says nothing
        # of its holder; the lease's remaining time does. etcd reports it truncated to whole seconds: a
        # lease kept alive every fraction of a second reads granted - 1, and one left alone for a whole
        # second reads granted - 2 from that second on (measured on etcd 3.5.1: the step comes 1.00 s after
        # the last keep-alive). So granted - 1 - remaining is a lower bound on the silence, exact to the
        # whole second, measured where the keep-alives land: on the store's clock, not the reader's.
        if known is not None and known.lease:
            mod_revision, lease_id = known.mod_revision, known.lease
        else:
            entry = self.get(key)
            if entry is None:
                return None
            if not entry.lease:
                return Liveness(entry.mod_revision, 0, None)
            mod_revision, lease_id = entry.mod_revision, entry.lease
        if self._client.lease is None:
            raise StoreUnavailable("store closed")
        lease = self.run(f"time to live of {key}'s lease",
                         self._client.lease.time_to_live(lease_id, timeout=self._timeout,
                                                         max_attempts=READ_ATTEMPTS))
        if lease.TTL < 0:  # expired or revoked: its keys go (or went) with it
            return None
        return Liveness(mod_revision, lease_id, float(max(0, lease.grantedTTL - 1 - lease.TTL)))

    def expire(self, key: str, mod_revision: int) -> bool:
        # LeaseRevoke is no transaction operation: the compare is a read first. The window between the
        # two is harmless: the key's lease only changes when its holder writes it again under a new one,
        # and then it is the old lease that goes.
        entry = self.get(key)
        if entry is None or entry.mod_revision != mod_revision:
            return False
        if not entry.lease:
            return self.delete(key, mod_revision=mod_revision)
        self.run(f"revoke of {key}'s lease", self.revoke_quietly(entry.lease))
        return True

    async def keepalive_once(self, lease_id: int) -> int:
        """One LeaseKeepAlive request on the store's keep-alive stream, and its answer's TTL (<= 0: the
        lease is gone)."""
        if self._client._channel is None:
            raise StoreUnavailable("store closed")
        return await self._keepalives.renew(self._client._channel, lease_id)

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
            self._loop.call(self._keepalives.close(), 5.0)
            self._loop.call(self._client.close(), 5.0)
        finally:
            if self._own_loop:
                self._loop.close()


# --- etcd3aio for the v3 backend: importing it beside python-etcd, and its failures as the store's errors.
#
# Both python-etcd and etcd3aio's generated protobuf modules are a top-level package named `etcd`:
# python-etcd's is a regular package, etcd3aio's (`etcd3aio/proto/etcd/api/...`, reached through the
# `etcd3aio/proto` directory its `_protobuf.py` puts first on sys.path) a namespace package, and a regular
# package always wins the name. Importing etcd3aio in a process that has python-etcd installed therefore
# fails (`No module named 'etcd.api'`) whatever the order, unless the `etcd` in sys.modules has etcd3aio's
# directory on its path: python-etcd's, extended, or a package of the protos alone until python-etcd is
# needed (petctl/io/etcdname.py). `etcd.Client` is then python-etcd's and `etcd.api` etcd3aio's, in one
# process (a CLI reading both backends, the store contract tests).

def import_etcd3aio() -> ModuleType:
    """etcd3aio, importable beside python-etcd (see the comment above). Raises ImportError when
    etcd3aio is not installed."""
    spec = importlib.util.find_spec("etcd3aio")
    if spec is None or spec.origin is None:
        raise ImportError("etcd3aio is not installed: pip install 'etcd3aio>=0.3,<0.4'")
    # The name `etcd` for etcd3aio's protos, without loading python-etcd (its urllib3 and dnspython cost an
    # agent 0.1 s of CPU at start): petctl/io/etcdname.py.
    etcdname.claim_for_protos(str(Path(spec.origin).parent / "proto" / "etcd"))
    # gRPC's fork handlers, read when grpc is first imported: the agent forks its workers (which exec, or
    # never touch gRPC) while its store's threads are in calls, and gRPC then logs "Other threads are
    # currently calling into gRPC, skipping fork() handlers" on every fork, into the agent's event log.
    # A user's own setting wins.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    import etcd3aio

    return etcd3aio


def store_error(e: BaseException, what: str) -> StoreError | None:
    """What an etcd3aio or gRPC failure means to a store caller, or None for one that is not a store
    failure (a bug: let it raise). No permission, or a certificate naming no user → StoreDenied; a lease
    etcd no longer has → LeaseExpired; down, unreachable, too slow, no leader → StoreUnavailable."""
    import grpc
    from etcd3aio import errors

    if isinstance(e, StoreError):
        return e
    if isinstance(e, (errors.EtcdPermissionDeniedError, errors.EtcdUnauthenticatedError)):
        return StoreDenied(f"{what}: {e}")
    if isinstance(e, (errors.EtcdConnectionError, errors.EtcdTransientError, TimeoutError)):
        return StoreUnavailable(f"{what}: {e or 'timed out'}")
    if isinstance(e, grpc.aio.AioRpcError):
        code, detail = e.code(), e.details() or ""
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or (
                "user name not found" in detail or "authentication failed" in detail):
            return StoreDenied(f"{what}: {code.name} {detail}")
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in detail:
            return LeaseExpired(f"{what}: {detail}")
        return StoreUnavailable(f"{what}: {code.name} {detail}")
    if isinstance(e, OSError):
        return StoreUnavailable(f"{what}: {e}")
    return None


# --- The store's LeaseKeepAlive stream: one bidirectional stream, opened on the first keep-alive and kept.
#
# etcd answers each request on the stream with the lease's ID and remaining TTL, in order. Keep-alives of
# one store take turns (a lock): send one request, read answers until the one for that lease. Any failure
# or timeout (a cancellation) closes the stream, so no answer of an abandoned request is ever read as the
# answer to a later one, and the next keep-alive opens a new stream: after an etcd restart, or on another
# member when the one in use is lost, as a fresh stream each time did.

class KeepAliveStream:
    """One store's LeaseKeepAlive stream; used on the store's loop only."""

    def __init__(self) -> None:
        self._call: Any = None
        self._requests: asyncio.Queue[Any] | None = None
        self._lock: asyncio.Lock | None = None

    async def renew(self, channel: Any, lease_id: int) -> int:
        """Send one keep-alive for `lease_id` and return the TTL etcd answered (<= 0: the lease is gone).
        Raises what the stream raised (gRPC errors, mapped by the caller), StoreUnavailable when etcd
        ended the stream; the stream is closed then, and on a cancellation."""
        from etcd3aio._protobuf import LeaseKeepAliveRequest, LeaseStub
        from grpc.aio import EOF

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._call is None:
                requests: asyncio.Queue[Any] = asyncio.Queue()

                async def send() -> Any:  # the request side stays open until the stream is closed
                    while True:
                        yield await requests.get()

                self._requests, self._call = requests, LeaseStub(channel).LeaseKeepAlive(send())
            call, requests = self._call, self._requests
            assert requests is not None
            try:
                requests.put_nowait(LeaseKeepAliveRequest(ID=lease_id))
                while True:
                    response = await call.read()
                    if response is EOF:
                        raise StoreUnavailable(f"keepalive of lease {lease_id}: etcd ended the stream")
                    if response.ID == lease_id:
                        return response.TTL
            except BaseException:
                self._drop()
                raise

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = self._requests = None

    async def close(self) -> None:
        """Cancel the stream, if one is open; idempotent."""
        self._drop()


# --- A v3 watch on a directory (or one key), read on the store's loop into a queue a blocking `wait` reads.
#
# It drives etcd's Watch stream itself rather than through etcd3aio's `WatchService.watch`, because that
# generator hides two things petctl must see: it skips ahead silently past a compaction (petctl re-lists
# instead), and it resumes a broken stream from the last response's header revision, which for a watch
# created on old history is the current revision, ahead of events not yet delivered (a loss). Here a
# broken stream resumes from the revision after the last event delivered, and each break is reported
# once to the waiter as StoreUnavailable while it reconnects.

RECONNECT_FIRST = 0.2  # seconds before the first reconnect of a broken watch stream, doubling ...
RECONNECT_MAX = 2.0  # ... up to this


def _event(ev: Any) -> Event:
    kv = ev.kv
    if ev.type == 1:  # mvccpb.Event.DELETE (an expired lease's keys too)
        return Event("delete", kv.key.decode(), None, kv.mod_revision)
    return Event("put", kv.key.decode(), kv.value.decode(), kv.mod_revision)


class V3Watch:
    """See the module docstring. One thread waits on it at a time."""

    def __init__(self, loop: LoopThread, channel: Any, key: str, prefix: bool, start_revision: int,
                 timeout: float) -> None:
        """`prefix`: watch every key under the directory `key` (`key + "/"` as a prefix); else `key` alone."""
        self._loop = loop
        self._queue: queue.Queue[tuple[Event, ...] | StoreError] = queue.Queue()
        self._pending: collections.deque[tuple[Event, ...] | StoreError] = collections.deque()
        self._fatal: StoreError | None = None
        self._seen = max(1, start_revision) - 1
        self._closed = False
        self.requests = 1  # Watch streams opened (`Watch.requests`): this one, opened on the loop at once
        name = key.rstrip("/") + "/" if prefix else key
        self._task = loop.call(self._start(channel, name, prefix, max(1, start_revision)), timeout)

    async def _start(self, channel: Any, name: str, prefix: bool, start: int) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._consume(channel, name, prefix, start))

    async def _consume(self, channel: Any, name: str, is_prefix: bool, start: int) -> None:
        from etcd3aio._protobuf import WatchCreateRequest, WatchRequest, WatchStub
        from etcd3aio.kv import prefix_range_end

        stub = WatchStub(channel)
        prefix = name  # what errors name
        key, end = name.encode(), prefix_range_end(name) if is_prefix else b""
        following, backoff, reconnect = start, RECONNECT_FIRST, False
        while True:
            create = WatchCreateRequest(key=key, range_end=end, start_revision=following)

            async def requests(create: Any = create) -> Any:
                yield WatchRequest(create_request=create)
                await asyncio.Future()  # keep the request side open: closing it ends the watch

            if reconnect:  # the first stream is counted already (`requests`)
                self.requests += 1
            reconnect = True
            stream = stub.Watch(requests())
            try:
                async for response in stream:
                    backoff = RECONNECT_FIRST
                    if response.compact_revision > 0:
                        self._queue.put(Compacted(response.compact_revision))
                        return
                    if response.canceled:
                        reason = response.cancel_reason or "canceled by etcd"
                        denied = "permission denied" in reason or "auth" in reason
                        error = StoreDenied if denied else StoreUnavailable
                        self._queue.put(error(f"watch {prefix}: {reason}"))
                        return
                    if response.events:
                        events = tuple(_event(ev) for ev in response.events)
                        following = events[-1].revision + 1
                        self._queue.put(events)
                self._queue.put(StoreUnavailable(f"watch {prefix}: etcd ended the stream"))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - mapped; a failure that is no store failure is a bug
                mapped = store_error(e, f"watch {prefix}")
                self._queue.put(mapped if mapped is not None else StoreUnavailable(f"watch {prefix}: {e!r}"))
                if mapped is None or not isinstance(mapped, StoreUnavailable):
                    return
            finally:
                stream.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_MAX)

    def wait(self, timeout: float) -> Batch:
        if self._closed:
            raise StoreUnavailable("watch closed")
        if self._fatal is not None:
            raise self._fatal
        items = self._take(timeout)
        if self._closed:  # closed from another thread while this wait was in progress
            raise StoreUnavailable("watch closed")
        events: list[Event] = []
        while items:
            item = items[0]
            if isinstance(item, StoreError):
                if events:
                    break
                items.popleft()
                if not isinstance(item, StoreUnavailable):
                    self._fatal = item
                while items and isinstance(items[0], StoreUnavailable):  # one outage, one error
                    items.popleft()
                self._pending = items
                raise item
            events.extend(items.popleft())
        self._pending = items
        if events:
            self._seen = events[-1].revision
        return Batch(tuple(events), self._seen)

    def _take(self, timeout: float) -> collections.deque:
        items = self._pending
        if not items:
            try:
                items.append(self._queue.get(timeout=max(0.0, timeout)))
            except queue.Empty:
                return items
        while True:  # and what else already arrived, without waiting
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(StoreUnavailable("watch closed"))  # wakes a wait in progress at once
        try:
            self._loop.call(_cancel(self._task), 5.0)
        except StoreUnavailable:  # the loop is already closed: nothing runs on it any more
            pass


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# --- An asyncio loop in a daemon thread, and blocking calls into it: how the agent (threads and blocking
# calls) drives the asyncio-only etcd3aio client of the v3 backend.
#
# One `LoopThread` serves any number of stores: each v3 store starts its own unless it is given one, so a
# fleet bench can put 1,000 simulated nodes' stores on a single loop thread.

T = TypeVar("T")


class LoopThread:
    """A running event loop on its own daemon thread; `call` runs a coroutine there and waits for it."""

    def __init__(self, name: str = "petctl-store-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and return its result, or raise what it raised. A coroutine that has
        not finished within `timeout` seconds is cancelled: StoreUnavailable (the coroutines bound
        their own RPCs; this is the backstop). Never call it from the loop's own thread (deadlock)."""
        if self._closed:
            coro.close()
            raise StoreUnavailable("store closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if not future.done():
                future.cancel()
                raise StoreUnavailable(f"no answer within {timeout:.1f}s") from None
            raise

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(5.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)
        self.loop.close()


async def _cancel_all() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
