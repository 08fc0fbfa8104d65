"""The agent's leases by TTL class, for the keys that carry a TTL from their write: join and done
records, the node's status, its events (the heartbeat's own lease is kept alive instead: liveness.py).

Each class has one lease at a time, granted with twice the class's TTL and used for `ttl` seconds, then
replaced by a new one: a key written under it lives at least `ttl` and at most 2 x `ttl` past its write
(v2's TTL'd write gave exactly `ttl`), and nothing keeps these leases alive, so they cost no request at
rest. A replaced lease is never revoked: its keys (a week of events, say) expire with it, as they would
have with their own TTLs. A lease found gone (an etcd wiped and restarted, a v3 lease revoked) is replaced
at once and the write retried, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from petctl.core.store import Lease, LeaseExpired, Store


class LeaseClasses:
    """One rotating lease per TTL class of one node (see the module docstring). Safe across threads."""

    def __init__(self, kv: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock
        self._held: dict[float, tuple[Lease, float]] = {}  # ttl -> (lease, when it was granted)
        self._lock = threading.Lock()

    def lease(self, ttl: float) -> Lease:
        """The class's lease: one granted less than `ttl` seconds ago, else a new one. Raises
        StoreUnavailable (a grant is a request on v3)."""
        with self._lock:
            held = self._held.get(ttl)
            now = self.clock()
            if held is None or now - held[1] >= ttl:
                held = (self.kv.grant(2 * ttl), now)
                self._held[ttl] = held
            return held[0]

    def put(self, key: str, value: str, ttl: float, new: bool = False) -> None:
        """Write `key` under the class's lease. `new`: the key is most likely not there yet (an event's
        own key, a join or done record of a new round): a create-only write is tried first, then a put
        where the key did exist, so the usual case costs one request on v2 too (where a put of a
        missing key is two: an update refused, then a create). Raises StoreError (StoreUnavailable, or
        LeaseExpired when a fresh lease is gone too)."""
        try:
            self._write(key, value, self.lease(ttl), new)
        except LeaseExpired:
            with self._lock:
                self._held.pop(ttl, None)
            self._write(key, value, self.lease(ttl), new)

    def _write(self, key: str, value: str, lease: Lease, new: bool) -> None:
        if not (new and self.kv.create(key, value, lease)):
            self.kv.put(key, value, lease)
