"""An asyncio loop in a daemon thread, and blocking calls into it: how the agent (threads and blocking
calls) drives the asyncio-only etcd3aio client of the v3 backend.

One `LoopThread` serves any number of stores: each v3 store starts its own unless it is given one, so a
fleet bench can put 1,000 simulated nodes' stores on a single loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from petctl.core.store import StoreUnavailable

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
