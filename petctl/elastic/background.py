"""One background thread that uploads checkpoints, one at a time.

Why one thread and no queue: a checkpoint is only useful once it is complete, and two uploads racing for
the same bandwidth would both finish late. So a new save waits for the previous upload (the only time
training is held up by checkpointing), then hands its job to the thread and returns at once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundUploader:
    """Runs at most one job at a time off the training thread; errors go to `on_error`, never raised."""

    def __init__(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="petctl-ckpt",
                                        initializer=yield_cpu_to_training)
        self._pending: Future[Any] | None = None
        self._lock = threading.Lock()
        self._on_error = on_error
        self.waits = 0  # how often a save had to wait for the previous upload (for tests and events)

    @property
    def busy(self) -> bool:
        pending = self._pending
        return pending is not None and not pending.done()

    def wait(self) -> Any:
        """Block until the current job (if any) is done; returns its result or None if it failed."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return None
        try:
            return pending.result()
        except BaseException:  # noqa: BLE001 - the job's own failure, already reported through on_error
            return None

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Wait for the previous job, then start `job` in the background."""
        if self.busy:
            self.waits += 1
        self.wait()
        with self._lock:
            self._pending = self._pool.submit(self._run, job)
            return self._pending

    def _run(self, job: Callable[[], Any]) -> Any:
        try:
            return job()
        except BaseException as e:
            if self._on_error is not None:
                self._on_error(e)
            raise

    def close(self) -> None:
        """Finish the upload in flight (a checkpoint half uploaded is worth nothing), then stop."""
        self.wait()
        self._pool.shutdown(wait=True)


BACKGROUND_NICE = 10


def yield_cpu_to_training() -> None:
    """Lower this thread's CPU priority: when cores are short, the training step goes first.

    On Linux a nice value belongs to a thread, so this leaves the training thread as it was. Elsewhere
    (or if refused) the upload just runs at normal priority.
    """
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError):
        pass
