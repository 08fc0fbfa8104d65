"""The v2 backend's watch: a long poll (`wait=true&waitIndex=N&recursive=true`) on a directory.

One event per wait, resumed from the index after the last one returned. etcd keeps only the last 1,000
events: a wait that asks for an older one (error 401) raises Compacted. A recursive directory delete
is one delete event whose key is the directory, not one per key.
"""

from __future__ import annotations

import re
from typing import Protocol

import etcd

from petctl.core.store import Batch, Compacted, Event, StoreUnavailable
from petctl.io.store.v2calls import dirpath, errors, index

DELETES = ("delete", "expire", "compareAndDelete")
# etcd's cause for error 401: "the requested history has been cleared [oldest/asked]"
_CLEARED = re.compile(r"\[(\d+)/\d+\]")


class Source(Protocol):
    def client(self) -> etcd.Client: ...


class V2Watch:
    """A v2 long poll on a directory, resumed from the index after the last event it returned."""

    def __init__(self, store: Source, directory: str, start_revision: int) -> None:
        self._store = store
        self._dir = dirpath(directory)
        self._next = max(1, start_revision)
        self._seen = self._next - 1
        self._closed = False

    def wait(self, timeout: float) -> Batch:
        if self._closed:
            raise StoreUnavailable("watch closed")
        client = self._store.client()
        with errors(f"watch {self._dir}"):
            try:
                node = client.watch(self._dir, index=self._next, timeout=timeout, recursive=True)
            except etcd.EtcdWatchTimedOut:
                return Batch((), self._seen)
            except etcd.EtcdEventIndexCleared as e:
                found = _CLEARED.search(str((e.payload or {}).get("cause", "")))
                raise Compacted(int(found.group(1)) if found else index(e) - 999) from None
        revision = int(node.modifiedIndex)
        kind = "delete" if node.action in DELETES else "put"
        event = Event(kind, node.key, node.value if kind == "put" else None, revision)
        self._next = revision + 1
        self._seen = revision
        return Batch((event,), revision)

    def close(self) -> None:
        self._closed = True
