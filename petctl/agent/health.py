"""The health of the agent's services: each outage reported once (`OutageReporter`), whether etcd can be
trusted on membership (`StoreHealth`), and the fence of a node cut off from it.

Sections: the outage reporter every background service uses; the store's health, to which the etcd-facing ones
forward; fencing (the pure rule and the fence itself).

Whether this node can trust what etcd says about membership right now: the store's health, as seen here.

A training job needs etcd only to change membership; its workers talk to each other directly. So a store
that stalls, restarts or is replaced must not stop training, and above all must not be mistaken for lost
nodes. When etcd stalls for longer than the heartbeat TTL, every heartbeat (ours included) expires
together once it resumes: absences read then are the outage's, not node losses.

`StoreHealth` collects what every etcd-facing service of the agent sees (the heartbeat, the `live/`
watch, views, the status and event writes) and answers two questions:
- `settled()`: may membership be judged from etcd? Not while etcd fails, and not for `grace` seconds
  after the last *disturbance*: a failed call, a call slower than `slow` (a refresh that late may have let
  our key lapse), or our own heartbeat found gone. `grace` is long enough for every live node to notice
  and re-assert its heartbeat (liveness.py), so a node still missing after it is really gone.
- `unreachable_for()`: how long etcd has failed without a single success (the fence, below, uses it).

The outage is reported once for the whole agent (`store.unreachable` when it starts, `store.reachable`
when it ends, with its length and failed calls); the services still count their own failures
(`NodeStatus.failures`), quietly (`OutageReporter`, above).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from petctl.io import controlfiles
from petctl.io.eventlog import EventLog

# --- outage reporter ----------------------------------------------------------------------------------------
# One way for the agent's background services to fail loudly without flooding: the outage reporter.
#
# A service that talks to something remote (the etcd watch, the heartbeat, the event sink, the status
# publication) retries on its own schedule; what a person needs is one event when its calls start failing,
# one when they work again, and a count. That is the pattern imds.py started with; every service uses this
# class for it, and the counts are published in the node's status (`NodeStatus.failures`), where
# `petctl status` shows them.
#
# The services that talk to etcd share one parent, the agent's `StoreHealth` (below): they still
# count their own failures, but forward every call's outcome to it and stay quiet, so an etcd outage is
# reported once for the agent, not once per service.

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


# --- store health -------------------------------------------------------------------------------------------

class StoreHealth:
    def __init__(self, emit: Emit, grace: float, slow: float, straggle: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace = grace
        self.slow = slow
        # A call sent before etcd came back can still fail up to one call timeout later: a failure that
        # soon after a recovery disturbs (and is counted) but starts no new outage.
        self.straggle = straggle
        self.outages = 0  # outages so far (each reported twice)
        self._emit = emit
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None  # first failure of the current outage
        self._failed_calls = 0  # failed calls in the current outage
        self._disturbed_at: float | None = None  # the latest disturbance (failure, slow call, own key gone)
        self._recovered_at: float | None = None  # the end of the latest outage

    # --- what the services report ---------------------------------------------------------------------
    def failed(self, error: BaseException | str, service: str = "") -> None:
        """One etcd call failed (any service). The first failure of an outage is reported."""
        now = self._clock()
        with self._lock:
            self._disturbed_at = now
            straggler = (self._down_since is None and self._recovered_at is not None
                         and now - self._recovered_at < self.straggle)
            if straggler:
                return
            self._failed_calls += 1
            first = self._down_since is None
            if first:
                self._down_since = now
                self.outages += 1
        if first:
            self._emit("store.unreachable", service=service, error=describe(error))

    def succeeded(self, seconds: float = 0.0, service: str = "") -> None:
        """One etcd call succeeded, after `seconds`; ends the outage (reported) if there was one."""
        now = self._clock()
        with self._lock:
            since, calls = self._down_since, self._failed_calls
            self._down_since, self._failed_calls = None, 0
            if since is not None or seconds > self.slow:
                self._disturbed_at = now
            if since is not None:
                self._recovered_at = now
        if since is not None:
            self._emit("store.reachable", service=service, seconds=round(now - since, 3), failed_calls=calls)
        elif seconds > self.slow:
            self._emit("store.slow", service=service, seconds=round(seconds, 3))

    def own_key_missing(self) -> None:
        """Our heartbeat key was gone though we kept refreshing it: the store expired or lost it."""
        with self._lock:
            self._disturbed_at = self._clock()

    # --- what the decisions ask ---------------------------------------------------------------------
    def settled(self) -> bool:
        """True when membership read from etcd can be trusted (see the module docstring)."""
        now = self._clock()
        with self._lock:
            if self._down_since is not None:
                return False
            return self._disturbed_at is None or now - self._disturbed_at >= self.grace

    def unreachable_for(self) -> float | None:
        """Seconds since the current outage began (no success since), or None when etcd answers."""
        with self._lock:
            since = self._down_since
        return None if since is None else self._clock() - since

    def as_dict(self) -> dict[str, Any]:
        return {"outages": self.outages, "settled": self.settled(), "unreachable_for": self.unreachable_for()}


# --- fencing ------------------------------------------------------------------------------------------------
# When a node cut off from etcd must stop its own workers: the fence, as a pure rule.
#
# A node that cannot reach etcd cannot tell a store outage (every node cut off, the job healthy) from its
# own partition (the others reached etcd, dropped it after one heartbeat TTL and re-formed without it). What
# tells them apart is its workers: in a store outage the collectives still complete and steps keep coming;
# cut off from its peers, a worker blocks in its next collective. So the node fences itself only when both
# hold: etcd has not answered for longer than the heartbeat TTL (the others may have dropped it by now), and
# its workers, which did report steps this round, have reported none for longer than `stall_limit`.
#
# Fenced, the agent writes the fence control file (a worker never commits a checkpoint while it exists:
# io/controlfiles.py), stops its workers, and rejoins once etcd answers. A script that reports no steps
# is never fenced on a stall (nothing tells a stall from a quiet phase); it is stopped when etcd answers and
# shows the round has moved on, as before.

STALL_TTLS = 2.0  # a stall is at least this many heartbeat TTLs ...
STALL_GAPS = 4.0  # ... and this many of the round's longest gap between two steps


@dataclass(frozen=True)
class FenceLook:
    """What the round runner knows when it asks."""

    unreachable_for: float | None  # seconds etcd has failed without one success; None: it answers
    stalled_for: float | None  # seconds since the workers' last step; None: no step reported this round
    longest_gap: float  # the longest time between two steps this round (slow steps are not stalls)
    workers_running: bool


def stall_limit(ttl: float, longest_gap: float) -> float:
    """How long without a step is a stall, for a job whose steps take up to `longest_gap`."""
    return max(STALL_TTLS * ttl, STALL_GAPS * longest_gap)


def should_fence(look: FenceLook, ttl: float) -> bool:
    """True when this node must assume it was dropped from its round (see the module docstring)."""
    if look.unreachable_for is None or look.stalled_for is None or not look.workers_running:
        return False
    return look.unreachable_for > ttl and look.stalled_for > stall_limit(ttl, look.longest_gap)


def fence(look: FenceLook, round_no: int, control_dir: Path, events: EventLog,
          stop_workers: Callable[[], dict[int, int]]) -> None:
    """Fence this node: the fence file first (no worker commits a checkpoint from then on), then one
    `agent.fenced` line, then stop the workers."""
    reason = (f"etcd unreachable for {look.unreachable_for or 0:.1f}s and no step for "
              f"{look.stalled_for or 0:.1f}s: this node may have been dropped from round {round_no}")
    controlfiles.write_fence(control_dir, round_no, reason)
    events.emit("agent.fenced", round=round_no, unreachable_for=round(look.unreachable_for or 0, 3),
                stalled_for=round(look.stalled_for or 0, 3))
    codes = stop_workers()
    events.emit("workers.stopped", round=round_no, why="fenced", codes=codes)
