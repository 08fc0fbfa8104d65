"""The one way tests read and write etcd: a `Store` (petctl/core/store.py), never python-etcd directly.

`store_for` opens one on a test's etcd with the backend a job's agents use by default
(`JOB_DEFAULT_BACKEND`), so a test reads what the agents wrote (etcd 3.5 keeps its v2 and v3 keyspaces
apart). Close it when done (a v3 store holds a loop thread), or use it as a context manager via
`contextlib.closing`. `FakeStore` is the in-memory stand-in for tests of how the agent's services
handle a failing store.
"""

from __future__ import annotations

import itertools
import time

from petctl.core.store import JOB_DEFAULT_BACKEND, Backend, Lease, LeaseExpired, Store, StoreUnavailable
from petctl.io.etcdpki import EtcdTls
from petctl.io.store import open_store


def store_for(endpoint: str, tls: EtcdTls | None = None, backend: Backend = JOB_DEFAULT_BACKEND,
              timeout: float = 3.0) -> Store:
    """A store on `endpoint` (a test's etcd, `http(s)://...`), as `tls`'s user when it is https."""
    return open_store(endpoint, backend, tls, timeout)


class FakeStore:
    """The part of a `Store` the agent's heartbeat, status and event sink use, in memory, for tests of
    how they handle failures: the next `failures` calls raise StoreUnavailable; once `gone` is set a
    keep-alive raises LeaseExpired (until the next put); the `stall_at`-th keep-alive sleeps `stall`
    seconds first. `calls` names every call (grant, put, keepalive, revoke); `writes` counts puts."""

    backend = "v2"

    def __init__(self, failures: int = 0, stall_at: int = 0, stall: float = 0.0) -> None:
        self.failures = failures
        self.stall_at, self.stall = stall_at, stall
        self.calls: list[str] = []
        self.data: dict[str, str] = {}
        self.writes = 0
        self.keepalives = 0
        self.gone = False
        self._ids = itertools.count(1)

    def call(self, what: str) -> None:
        self.calls.append(what)
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable("connection refused")

    def grant(self, ttl: float) -> FakeLease:
        self.call("grant")
        return FakeLease(self, next(self._ids), ttl)

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        self.call("put")
        self.writes += 1
        self.gone = False
        self.data[key] = value
        return self.writes

    def create(self, key: str, value: str, lease: Lease | None = None) -> bool:
        if key in self.data:
            self.call("create")
            return False
        self.put(key, value, lease)
        return True


class FakeLease:
    def __init__(self, store: FakeStore, lease_id: int, ttl: float) -> None:
        self.store, self.id, self.ttl = store, lease_id, ttl

    def keepalive(self) -> None:
        store = self.store
        store.keepalives += 1
        if store.keepalives == store.stall_at:
            time.sleep(store.stall)
        store.call("keepalive")
        if store.gone:
            raise LeaseExpired(f"lease {self.id} expired")

    def revoke(self) -> None:
        self.store.call("revoke")
