"""One way for the agent's background services to fail loudly without flooding: the outage reporter.

A service that talks to something remote (the etcd watch, the heartbeat, the event sink, the status
publication) retries on its own schedule; what a person needs is one event when its calls start failing,
one when they work again, and a count. That is the pattern imds.py started with; every service uses this
class for it, and the counts are published in the node's status (`NodeStatus.failures`), where
`petctl status` shows them.

The services that talk to etcd share one parent, the agent's `StoreHealth` (storehealth.py): they still
count their own failures, but forward every call's outcome to it and stay quiet, so an etcd outage is
reported once for the agent, not once per service.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

Emit = Callable[..., Any]  # EventLog.emit's shape: emit(event, **fields)


class Parent(Protocol):
    """Where a quiet reporter forwards its calls' outcomes (StoreHealth)."""

    def failed(self, error: BaseException | str, service: str = "") -> None: ...

    def succeeded(self, seconds: float = 0.0, service: str = "") -> None: ...


class OutageReporter:
    """Counts failed attempts of one service and reports each outage twice (start and end)."""

    def __init__(self, service: str, emit: Emit, down_event: str = "", up_event: str = "",
                 clock: Callable[[], float] = time.monotonic, parent: Parent | None = None) -> None:
        self.service = service
        self.parent = parent  # set: forward every outcome there and report nothing here
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
        if self.parent is not None:
            self.parent.failed(error, self.service)
        elif first:
            self._emit(self._down, service=self.service, error=describe(error), **fields)

    def succeeded(self, seconds: float = 0.0, **fields: Any) -> None:
        """One successful attempt (that took `seconds`, when the caller timed it); ends the outage
        (reported) if there was one."""
        with self._lock:
            since, count = self._since, self._in_outage
            self._since, self._in_outage = None, 0
        if self.parent is not None:
            self.parent.succeeded(seconds, self.service)
        elif since is not None:
            self._emit(self._up, service=self.service, failures=count,
                       seconds=round(self._clock() - since, 3), **fields)


def describe(error: BaseException | str, limit: int = 300) -> str:
    """One short line: some libraries quote whole HTML pages or multi-line tracebacks in errors."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def traceback_tail(error: BaseException, lines: int = 20) -> list[str]:
    """The last `lines` lines of `error`'s formatted traceback (the raising frames and the exception):
    what `agent.crashed` carries, so the cause of a crash is in the job's events (and the mirror), not
    only in the log of an instance that may be gone."""
    import traceback

    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return text.rstrip("\n").splitlines()[-lines:]
