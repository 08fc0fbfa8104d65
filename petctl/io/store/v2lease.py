"""The v2 backend's emulated lease: v2 has no leases, so one is a local object over TTL'd keys.

Its id is a local counter (meaningless to other clients, which see `Entry.lease == 0`). A key put under
it gets a TTL of the lease's remaining time and is remembered; `keepalive` refreshes every such key
(`refresh=True, prevExist=True`: one raft proposal per key, unseen by watchers, but it moves the key's
modifiedIndex) and raises LeaseExpired when the lease's time ran out first or a key is gone, deleting
the rest as v3 would have; `revoke` deletes them one by one.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Protocol

import etcd

from petctl.core.store import LeaseExpired
from petctl.io.store.v2calls import errors


class Holder(Protocol):
    """What a lease needs of its store: this thread's client, and to be forgotten once gone."""

    def client(self) -> etcd.Client: ...

    def forget(self, lease: V2Lease) -> None: ...


class V2Lease:
    """An emulated lease (see the module docstring): the keys written under it, and when it runs out."""

    def __init__(self, store: Holder, lease_id: int, ttl: int) -> None:
        self._store = store
        self._id = lease_id
        self._ttl = ttl
        self._expires = time.monotonic() + ttl
        self._keys: set[str] = set()
        self._gone = False
        self._lock = threading.Lock()

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> float:
        return float(self._ttl)

    def remaining(self) -> int:
        """Whole seconds left (at least 1) for a key written under it now. Raises LeaseExpired."""
        left = self._expires - time.monotonic()
        if self._gone or left <= 0:
            raise LeaseExpired(f"lease {self._id} expired")
        return max(1, math.ceil(left))

    def expired(self) -> bool:
        """Its time ran out, or it was revoked: no key is held under it any more."""
        return self._gone or self._expires <= time.monotonic()

    def attach(self, key: str) -> None:
        with self._lock:
            self._keys.add(key)

    def detach(self, key: str) -> None:
        with self._lock:
            self._keys.discard(key)

    def _held(self) -> list[str]:
        with self._lock:  # a copy: another thread may put under this lease meanwhile
            return sorted(self._keys)

    def holds(self, key: str) -> bool:
        return key in self._keys

    def keepalive(self) -> None:
        started = time.monotonic()
        try:
            self.remaining()
        except LeaseExpired:
            self.revoke()
            raise
        client = self._store.client()
        for key in self._held():
            with errors(f"keepalive of lease {self._id}"):
                try:
                    client.refresh(key, ttl=self._ttl)
                except etcd.EtcdKeyNotFound:
                    self.revoke()
                    raise LeaseExpired(f"lease {self._id} expired: {key} is gone") from None
        self._expires = started + self._ttl

    def revoke(self) -> None:
        client = self._store.client()
        for key in self._held():
            with errors(f"revoke of lease {self._id}"), contextlib.suppress(etcd.EtcdKeyNotFound):
                client.delete(key)
            self.detach(key)
        self._gone = True
        self._store.forget(self)
