"""The v3 backend of `Store` (petctl/core/store.py), the default: etcd's gRPC API, spoken by petctl's own
client (petctl/io/store/v3wire.py: gRPC's framing and etcd's protobuf messages, over HTTP/2 framed by
petctl/io/store/http2.py).

Why gRPC and not the JSON gateway (etcd3gw): etcd's gRPC gateway refuses client certificates that carry
a CN (etcd PR #10392), and petctl authenticates every job by its certificate's CN. Why not grpcio (and
etcd3aio over it, until v3wire): importing grpc (84 ms), protobuf and etcd3aio's generated modules (43 ms)
cost an agent a third of the 0.39 s of CPU it spends from launch to being ranked, and gRPC runs threads
of its own in every process, where 64 agents share 2 cores in the fleet bench.

The client is asyncio and the agent is threads and blocking calls: each store runs its channel on a
`LoopThread` (below; its own, or one shared by many stores) and every method is a blocking call
into it. How it maps the contract:
- compare-and-swap is a transaction: create compares `create_revision == 0`, replace and delete-if
  compare `mod_revision`;
- a lease is etcd's: `keepalive` sends ONE LeaseKeepAlive request and reads its answer (the agent owns
  the schedule); it is not a raft proposal, and TTL <= 0 in the answer is LeaseExpired. The requests go
  on one LeaseKeepAlive stream the store keeps open (`KeepAliveStream`), as etcd's own Go client does,
  not a fresh stream each: a fresh stream cost the grpcio client 0.81 ms of CPU per blocking
  `keepalive()` against 0.34 ms (2,000 keep-alives), and an agent sends five a second;
- a call fails within `timeout` when etcd does not answer: writes are tried once (a retried
  transaction could report False for its own success), reads up to 3 times inside that same bound;
  after every member failed, the channel tries again after a backoff capped at 1 s
  (RECONNECT_BACKOFF_MS), so a restarted etcd is used again within about a second;
- members: one connection at a time, to one member; a connection that cannot be made or is lost moves
  the channel to the next member (v3wire.Channel);
- TLS: the client certificate is presented on every member, and every member's server certificate is
  checked against the first member's address (petctl's server certificate lists every member's
  address: etcdpki.py), which is what a channel over several addresses needs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import math
import queue
import threading
import weakref
from collections.abc import Awaitable, Coroutine
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
from petctl.io.etcdpki import EtcdTls
from petctl.io.store import v3wire as wire

T = TypeVar("T")
READ_ATTEMPTS = 3
READ_BACKOFF = 0.05  # seconds before a read's second attempt, doubled before its third
RECONNECT_BACKOFF_MS = int(wire.RECONNECT_MAX * 1000)  # grpcio's own reached 120 s: a restarted etcd
# would sit unused that long
RETRIED = frozenset({wire.Status.UNAVAILABLE, wire.Status.DEADLINE_EXCEEDED})  # what a read tries again


def _entry(kv: wire.KeyValue) -> Entry:
    return Entry(key=kv.key.decode(), value=kv.value.decode(), mod_revision=kv.mod_revision,
                 create_revision=kv.create_revision, lease=kv.lease)


def _prefix(directory: str) -> str:
    return directory.rstrip("/") + "/"


def _range(prefix: str) -> tuple[bytes, bytes]:
    key = prefix.encode()
    return key, wire.prefix_range_end(key)


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
    """`Store` over etcd's gRPC API (v3wire); see the module docstring."""

    backend = "v3"

    def __init__(self, members: list[tuple[str, int]], tls: EtcdTls | None, timeout: float,
                 loop: LoopThread | None = None) -> None:
        """Opens no connection: the first call does. Raises OSError or ssl.SSLError when `tls`'s files
        do not load."""
        context = wire.client_context(tls.ca, tls.cert, tls.key) if tls is not None else None
        self._timeout = timeout
        self._own_loop = loop is None
        self._loop = loop or LoopThread()
        self._watches: weakref.WeakSet[V3Watch] = weakref.WeakSet()
        self._keepalives = KeepAliveStream()
        self._closed = False
        self._channel = wire.Channel(members, context, members[0][0] if tls is not None else None)

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

    def _call(self, what: str, rpc: wire.Rpc[T], request: Any) -> T:
        """One attempt of a unary call (a write: see the module docstring)."""
        if self._closed:
            raise StoreUnavailable("store closed")
        return self.run(what, self._channel.unary(rpc, request, self._timeout))

    def _read(self, what: str, rpc: wire.Rpc[T], request: Any) -> T:
        """A unary call tried up to READ_ATTEMPTS times, all within the store's timeout."""
        if self._closed:
            raise StoreUnavailable("store closed")
        return self.run(what, self._attempts(rpc, request))

    async def _attempts(self, rpc: wire.Rpc[T], request: Any) -> T:
        backoff = READ_BACKOFF
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return await self._channel.unary(rpc, request, self._timeout)
            except wire.GrpcError as e:
                if attempt == READ_ATTEMPTS or e.code not in RETRIED:
                    raise
            await asyncio.sleep(backoff)
            backoff *= 2
        raise AssertionError("unreachable")

    def get(self, key: str) -> Entry | None:
        response = self._read(f"get {key}", wire.RANGE, wire.RangeRequest(key=key.encode()))
        return _entry(response.kvs[0]) if response.kvs else None

    def list(self, directory: str) -> Listing:
        key, end = _range(_prefix(directory))
        request = wire.RangeRequest(key=key, range_end=end, sort_order=wire.SortOrder.ASCEND,
                                    sort_target=wire.SortTarget.KEY)
        response = self._read(f"list {directory}", wire.RANGE, request)
        return Listing(tuple(_entry(kv) for kv in response.kvs), response.header.revision)

    def first_created(self, directory: str, limit: int) -> Listing:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        key, end = _range(_prefix(directory))
        request = wire.RangeRequest(key=key, range_end=end, limit=limit, sort_order=wire.SortOrder.ASCEND,
                                    sort_target=wire.SortTarget.CREATE)
        response = self._read(f"first created under {directory}", wire.RANGE, request)
        return Listing(tuple(_entry(kv) for kv in response.kvs), response.header.revision)

    def revision(self, directory: str = "/") -> int:
        key, end = _range(_prefix(directory))
        request = wire.RangeRequest(key=key, range_end=end, count_only=True)
        return self._read(f"revision via {directory}", wire.RANGE, request).header.revision

    def _lease_id(self, lease: Lease | None) -> int:
        if lease is None:
            return 0
        if not isinstance(lease, V3Lease):
            raise TypeError(f"not a lease of this store: {lease!r}")
        return lease.id

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        request = wire.PutRequest(key=key.encode(), value=value.encode(), lease=self._lease_id(lease))
        return self._call(f"put {key}", wire.PUT, request).header.revision

    def _txn(self, what: str, compare: wire.Compare, op: wire.RequestOp) -> bool:
        return self._call(what, wire.TXN, wire.TxnRequest(compare=[compare], success=[op])).succeeded

    @staticmethod
    def _compare(key: str, target: str, revision: int) -> wire.Compare:
        if target == "CREATE":
            return wire.Compare(result=wire.CompareResult.EQUAL, target=wire.CompareTarget.CREATE,
                                key=key.encode(), create_revision=revision)
        return wire.Compare(result=wire.CompareResult.EQUAL, target=wire.CompareTarget.MOD, key=key.encode(),
                            mod_revision=revision)

    @staticmethod
    def _put_op(key: str, value: str, lease: int) -> wire.RequestOp:
        put = wire.PutRequest(key=key.encode(), value=value.encode(), lease=lease)
        return wire.RequestOp(request_put=put)

    def create(self, key: str, value: str, lease: Lease | None = None) -> bool:
        op = self._put_op(key, value, self._lease_id(lease))
        return self._txn(f"create {key}", self._compare(key, "CREATE", 0), op)

    def replace(self, key: str, value: str, mod_revision: int, lease: Lease | None = None) -> bool:
        if mod_revision <= 0:  # a missing key's mod_revision is 0: comparing it would create the key
            return False
        op = self._put_op(key, value, self._lease_id(lease))
        return self._txn(f"replace {key}", self._compare(key, "MOD", mod_revision), op)

    def delete(self, key: str, mod_revision: int | None = None) -> bool:
        if mod_revision is None:
            request = wire.DeleteRangeRequest(key=key.encode())
            return self._call(f"delete {key}", wire.DELETE_RANGE, request).deleted > 0
        if mod_revision <= 0:
            return False
        compare = self._compare(key, "MOD", mod_revision)
        op = wire.RequestOp(request_delete_range=wire.DeleteRangeRequest(key=key.encode()))
        return self._txn(f"delete {key}", compare, op)

    def delete_dir(self, directory: str) -> int:
        key, end = _range(_prefix(directory))
        # Retried like a read: deleting a range twice leaves the same store, so a connection that failed
        # its handshake (seen under load with grpcio: UNAVAILABLE, "Handshake read failed") costs a
        # retry, not the call.
        request = wire.DeleteRangeRequest(key=key, range_end=end)
        return self._read(f"delete_dir {directory}", wire.DELETE_RANGE, request).deleted

    def grant(self, ttl: float) -> Lease:
        response = self._call("grant", wire.LEASE_GRANT, wire.LeaseGrantRequest(TTL=max(1, math.ceil(ttl))))
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
        lease = self._read(f"time to live of {key}'s lease", wire.LEASE_TIME_TO_LIVE,
                           wire.LeaseTimeToLiveRequest(ID=lease_id))
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
        if self._closed:
            raise StoreUnavailable("store closed")
        return await self._keepalives.renew(self._channel, lease_id)

    async def revoke_quietly(self, lease_id: int) -> None:
        """LeaseRevoke; a lease already gone is not an error."""
        if self._closed:
            raise StoreUnavailable("store closed")
        try:
            await self._channel.unary(wire.LEASE_REVOKE, wire.LeaseRevokeRequest(ID=lease_id), self._timeout)
        except Exception as e:
            if not isinstance(store_error(e, "revoke"), LeaseExpired):
                raise

    def watch(self, directory: str, start_revision: int) -> V3Watch:
        return self._watch(directory, True, start_revision)

    def watch_key(self, key: str, start_revision: int) -> V3Watch:
        return self._watch(key, False, start_revision)

    def _watch(self, key: str, prefix: bool, start_revision: int) -> V3Watch:
        if self._closed:
            raise StoreUnavailable("store closed")
        watch = V3Watch(self._loop, self._channel, key, prefix, start_revision, self._timeout)
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
            self._loop.call(self._channel.close(), 5.0)
        finally:
            if self._own_loop:
                self._loop.close()


def store_error(e: BaseException, what: str) -> StoreError | None:
    """What a failed call means to a store caller, or None for one that is not a store failure (a bug:
    let it raise). No permission, or a certificate naming no user → StoreDenied; a lease etcd no longer
    has → LeaseExpired; down, unreachable, too slow, no leader, any other gRPC status → StoreUnavailable."""
    if isinstance(e, StoreError):
        return e
    if isinstance(e, wire.GrpcError):
        code, detail = e.code, e.detail
        if code in (wire.Status.PERMISSION_DENIED, wire.Status.UNAUTHENTICATED) or (
                "user name not found" in detail or "authentication failed" in detail):
            return StoreDenied(f"{what}: {e.name} {detail}")
        if code == wire.Status.NOT_FOUND and "lease not found" in detail:
            return LeaseExpired(f"{what}: {detail}")
        return StoreUnavailable(f"{what}: {e.name} {detail}")
    if isinstance(e, TimeoutError):
        return StoreUnavailable(f"{what}: {e or 'timed out'}")
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
        self._stream: wire.Stream | None = None
        self._lock: asyncio.Lock | None = None

    async def renew(self, channel: wire.Channel, lease_id: int) -> int:
        """Send one keep-alive for `lease_id` and return the TTL etcd answered (<= 0: the lease is gone).
        Raises what the stream raised (GrpcError, mapped by the caller), StoreUnavailable when etcd
        ended the stream; the stream is closed then, and on a cancellation."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                if self._stream is None:
                    self._stream = await channel.open(wire.LEASE_KEEPALIVE)  # no deadline: kept open
                stream = self._stream
                await stream.send(wire.LeaseKeepAliveRequest(ID=lease_id))
                while True:
                    response = await stream.recv(wire.LeaseKeepAliveResponse)
                    if response is None:
                        raise StoreUnavailable(f"keepalive of lease {lease_id}: etcd ended the stream")
                    if response.ID == lease_id:
                        return response.TTL
            except BaseException:
                self._drop()
                raise

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        self._stream = None

    async def close(self) -> None:
        """Cancel the stream, if one is open; idempotent."""
        self._drop()


# --- A v3 watch on a directory (or one key), read on the store's loop into a queue a blocking `wait` reads.
#
# One Watch stream per watch, with one create request. Two things a general client's watch helper tends to
# hide, petctl must see: a compaction (petctl re-lists; skipping ahead past it silently would lose
# events), and where a broken stream resumes: from the revision after the last event delivered, not from
# the last response's header revision, which for a watch created on old history is the current revision,
# ahead of events not yet delivered (a loss). Each break is reported once to the waiter as
# StoreUnavailable while it reconnects.

RECONNECT_FIRST = 0.2  # seconds before the first reconnect of a broken watch stream, doubling ...
RECONNECT_MAX = 2.0  # ... up to this


def _event(ev: wire.Event) -> Event:
    kv = ev.kv
    if ev.type == 1:  # mvccpb.Event.DELETE (an expired lease's keys too)
        return Event("delete", kv.key.decode(), None, kv.mod_revision)
    return Event("put", kv.key.decode(), kv.value.decode(), kv.mod_revision)


class V3Watch:
    """See the module docstring. One thread waits on it at a time."""

    def __init__(self, loop: LoopThread, channel: wire.Channel, key: str, prefix: bool, start_revision: int,
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

    async def _start(self, channel: wire.Channel, name: str, prefix: bool, start: int) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._consume(channel, name, prefix, start))

    async def _consume(self, channel: wire.Channel, name: str, is_prefix: bool, start: int) -> None:
        prefix = name  # what errors name
        key = name.encode()
        end = wire.prefix_range_end(key) if is_prefix else b""
        following, backoff, reconnect = start, RECONNECT_FIRST, False
        while True:
            create = wire.WatchCreateRequest(key=key, range_end=end, start_revision=following)
            if reconnect:  # the first stream is counted already (`requests`)
                self.requests += 1
            reconnect = True
            stream: wire.Stream | None = None
            try:
                stream = await channel.open(wire.WATCH)  # no deadline; the request side stays open
                await stream.send(wire.WatchRequest(create_request=create))
                while (response := await stream.recv(wire.WatchResponse)) is not None:
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
                if stream is not None:
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
# calls) drives the v3 backend's asyncio client (v3wire).
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
