"""A v3 watch on a directory (or one key), consumed on the store's loop into a queue a blocking `wait` reads.

It drives etcd's Watch stream itself rather than through etcd3aio's `WatchService.watch`, because that
generator hides two things petctl must see: it skips ahead silently past a compaction (petctl re-lists
instead), and it resumes a broken stream from the last response's header revision, which for a watch
created on old history is the current revision, ahead of events not yet delivered (a loss). Here a
broken stream resumes from the revision after the last event delivered, and each break is reported
once to the waiter as StoreUnavailable while it reconnects.
"""

from __future__ import annotations

import asyncio
import collections
import queue
from typing import Any

from petctl.core.store import Batch, Compacted, Event, StoreDenied, StoreError, StoreUnavailable
from petctl.io.store.aioloop import LoopThread
from petctl.io.store.v3grpc import store_error

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
        following, backoff = start, RECONNECT_FIRST
        while True:
            create = WatchCreateRequest(key=key, range_end=end, start_revision=following)

            async def requests(create: Any = create) -> Any:
                yield WatchRequest(create_request=create)
                await asyncio.Future()  # keep the request side open: closing it ends the watch

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
