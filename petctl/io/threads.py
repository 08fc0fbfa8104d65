"""`Service`: a named daemon thread that loops until asked to stop, written once.

Why: the agent runs a dozen background loops (heartbeat, peer watch, metadata watcher, lifecycle
heartbeat, mirror, event sink, ...). Each used to spell out the same start and stop by hand: an Event, a
thread that may not exist yet, a join that must not be the thread joining itself. One copy keeps the
subtle parts right everywhere: a stop from inside the loop, a second start, a join that gives up.

    self._service = Service("heartbeat", self._run)
    self._stop = self._service.stopping       # the loop waits on it: `while not self._stop.wait(dt): ...`
    self._service.start()
    self._service.stop(timeout=5.0)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Service:
    """A daemon thread running `target(*args)` until `stop`; `stopping` is the Event its loop waits on."""

    def __init__(self, name: str, target: Callable[..., Any]) -> None:
        self.name = name
        self.target = target
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def started(self) -> bool:
        """Started and not yet stopped (its thread may have ended by itself)."""
        return self._thread is not None

    def start(self, *args: Any) -> bool:
        """Start the loop, unless it is started already (then nothing happens: False)."""
        if self._thread is not None:
            return False
        self.stopping.clear()
        self._thread = threading.Thread(target=self.target, args=args, name=self.name, daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the loop to end, and wait up to `timeout` seconds for it (never from the loop's own thread).

        True once the thread has ended (or none ran); False when it still runs after `timeout`: the
        caller reports that, since a daemon thread left running ends only with the process."""
        self.stopping.set()
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()
