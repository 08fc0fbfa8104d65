"""When a peer's heartbeat has gone silent, as pure functions: the peer watch (peerwatch.py) acts on them.

etcd v2 TTLs are whole seconds and etcd 3.5 removes expired keys only on its periodic sync (every 500 ms):
a 1 s TTL expires 1.0 to 1.5 s after the last refresh (measured), so expiry alone cannot drop a frozen
host within 1.5 s, and a shorter absolute deadline would drop every node together whenever etcd itself
stalls. So each member of a running round watches the next member in rank order (the last watches the
first) and judges it by *relative* silence, on its own monotonic clock:

- A refresh changes the key's `modifiedIndex`. The watcher reads the key every `poll` seconds and notes
  when it first saw the current index (`since`, taken after that read returned).
- The peer is silent once a read *sent* at least `limit` seconds after `since` still shows that index,
  and our own heartbeat got a refresh through that was sent at least one interval after `since`: etcd
  applied ours while the peer's, due as often, never came. An etcd that stalls delays both (no verdict);
  a watcher that is itself starved has no fresh refresh of its own (no verdict); a late read only
  shortens the span it can prove. While the store is not settled (storehealth.py) nothing is judged and
  the clock starts again.

Detection after a freeze is at most `limit` + 2 polls (+ the removal and the others' wake-up), about
1.2 s with the defaults; an absent key (expired, deleted, never written) is no verdict: etcd's TTL remains
the backstop where no watcher runs (between rounds, two neighbours lost at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from petctl.core.spec import Timeouts

MIN_MISSES = 4  # a peer is never judged silent before it missed this many refreshes
POLLS_PER_LIMIT = 10  # the watcher reads its peer's key this many times per silence limit


def silence_limit(t: Timeouts) -> float:
    """Seconds of silence after which the watcher drops its peer: `peer_silence`, but never fewer than
    MIN_MISSES refresh intervals (a longer `heartbeat_interval`, as on AWS, stretches it)."""
    return max(t.peer_silence, MIN_MISSES * t.heartbeat_interval)


def watching_enabled(t: Timeouts) -> bool:
    """Whether peers watch each other at all: not when etcd's own expiry (the TTL) is as fast."""
    return silence_limit(t) < t.heartbeat_ttl


def poll_period(limit: float) -> float:
    return limit / POLLS_PER_LIMIT


def successor(ranks: Mapping[str, int], node_id: str) -> str | None:
    """The member `node_id` watches: the next rank of the round, the last watching the first; None when
    it is alone (or not a member)."""
    order = sorted(ranks, key=lambda n: ranks[n])
    if node_id not in ranks or len(order) < 2:
        return None
    return order[(order.index(node_id) + 1) % len(order)]


@dataclass(frozen=True)
class Reading:
    """One read of the peer's heartbeat key, with what the watcher knew when it sent it."""

    node: str
    index: int | None  # the key's modifiedIndex; None: no key (expired, deleted, not written yet)
    sent: float  # monotonic, just before the read was sent
    received: float  # monotonic, just after its answer arrived
    # When our own latest applied refresh was sent (monotonic). Taken before this read was sent, so etcd
    # had applied that refresh before it answered the read. None: none went through yet.
    own_refresh_sent: float | None
    settled: bool  # StoreHealth.settled(): may membership be judged from etcd now?


@dataclass(frozen=True)
class Observation:
    """The peer's index as first seen, and when (monotonic, after the read that showed it returned)."""

    node: str
    index: int
    since: float


def observe(seen: Observation | None, r: Reading, limit: float,
            interval: float) -> tuple[Observation | None, float | None]:
    """What to remember, and how long the peer has provably been silent when that is `limit` or more
    (else None). See the module docstring for why each condition is there."""
    if not r.settled or r.index is None:
        return None, None
    if seen is None or seen.node != r.node or seen.index != r.index:
        return Observation(r.node, r.index, r.received), None
    silent = r.sent - seen.since
    ours_went_through = r.own_refresh_sent is not None and r.own_refresh_sent >= seen.since + interval
    if silent >= limit and ours_went_through:
        return seen, silent
    return seen, None
