"""One way for the agent's background services to fail loudly without flooding: the outage reporter.

A service that talks to something remote (the etcd watch, the heartbeat, the event sink, the status
publication) retries on its own schedule; what a person needs is one event when its calls start failing,
one when they work again, and a count. That is the pattern imds.py started with; every service uses this
class for it, and the counts are published in the node's status (`NodeStatus.failures`), where
`petctl status` shows them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Emit = Callable[..., Any]  # EventLog.emit's shape: emit(event, **fields)


class OutageReporter:
    """Counts failed attempts of one service and reports each outage twice (start and end)."""

    def __init__(self, service: str, emit: Emit, down_event: str = "", up_event: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.failures = 0  # failed attempts since the agent started
        self._emit = emit
        self._down = down_event or f"{service}.failing"
        self._up = up_event or f"{service}.recovered"
        self._clock = clock
        self._since: float | None = None  # start of the current outage
        self._in_outage = 0  # failed attempts in the current outage
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, error: BaseException | str, **fields: Any) -> None:
        """One failed attempt. The first of an outage is reported with its (one-line) error."""
        with self._lock:
            self.failures += 1
            self._in_outage += 1
            first = self._since is None
            if first:
                self._since = self._clock()
        if first:
            self._emit(self._down, service=self.service, error=describe(error), **fields)

    def succeeded(self, **fields: Any) -> None:
        """One successful attempt; ends the outage (reported) if there was one."""
        with self._lock:
            since, count = self._since, self._in_outage
            self._since, self._in_outage = None, 0
        if since is not None:
            self._emit(self._up, service=self.service, failures=count,
                       seconds=round(self._clock() - since, 3), **fields)


def describe(error: BaseException | str, limit: int = 300) -> str:
    """One short line: some libraries quote whole HTML pages or multi-line tracebacks in errors."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def traceback_tail(error: BaseException, lines: int = 20) -> str:
    """The last `lines` lines of `error`'s formatted traceback (the raising frames and the exception):
    what `agent.crashed` carries, so the cause of a crash is in the job's events, not only in one node's
    log."""
    import traceback

    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])
