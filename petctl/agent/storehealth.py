"""Whether this node can trust what etcd says about membership right now: the store's health, as seen here.

A training job needs etcd only to change membership; its workers talk to each other directly. So a store
that stalls, restarts or is replaced must not stop training, and above all must not be mistaken for lost
nodes. When etcd stalls for longer than the heartbeat TTL, every heartbeat (ours included) expires
together once it resumes: absences read then are the outage's, not node losses.

`StoreHealth` collects what every etcd-facing service of the agent sees (the heartbeat, the `live/`
watch, snapshots, the status and event writes) and answers two questions:
- `settled()`: may membership be judged from etcd? Not while etcd fails, and not for `grace` seconds
  after the last *disturbance*: a failed call, a call slower than `slow` (a refresh that late may have let
  our key lapse), or our own heartbeat found gone. `grace` is long enough for every live node to notice
  and re-assert its heartbeat (heartbeat.py), so a node still missing after it is really gone.
- `unreachable_for()`: how long etcd has failed without a single success (fencing.py uses it).

The outage is reported once for the whole agent (`store.unreachable` when it starts, `store.reachable`
when it ends, with its length and failed calls); the services still count their own failures
(`NodeStatus.failures`), quietly (outage.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from petctl.agent.outage import Emit, describe


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
