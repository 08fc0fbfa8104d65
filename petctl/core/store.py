"""The one interface between petctl and its coordination store (etcd), whichever API serves it.

etcd 3.6 and 3.7 serve only the v3 API; etcd 3.5 serves v2 too, until its support ends (about July 2027).
The agent, the jobview and the providers talk to a `Store` and never know which backend runs:
`petctl/io/store/v3.py` (the default: gRPC, leases, revisions, transactions) or `petctl/io/store/v2.py`
(python-etcd on an etcd 3.5 with `--enable-v2`, kept until 3.5's end of support). Both pass the one
contract suite in `tests/io/test_store_contract.py` against a real etcd.

The vocabulary is v3's, because v3 is where petctl is going:
- a **revision** is the store's logical clock. Every write has one (`Entry.mod_revision`), and a read
  says where the store stood (`Listing.revision`), so a watch started at `revision + 1` misses nothing
  between the read and the watch. On v2 it is the etcd index (`modifiedIndex`, `X-Etcd-Index`).
- a **lease** is liveness: keys written under one vanish together when its holder stops keeping it
  alive. On v3 a keep-alive is not a raft proposal (no fsync, no watcher woken); on v2 it is emulated by
  TTL'd keys refreshed one by one, each a proposal, which is why v2 stops scaling first.
- keys are `/`-separated paths (`/petctl/jobs/<job>/live/nodes/<node>`); `list` and `watch` take a
  directory and see every key beneath it, at any depth (v2's recursive read; v3's prefix `dir + "/"`).
  A key is never also a directory, on either backend.

This module is contracts only: records, errors and the protocol, no I/O and no third-party import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Backend = Literal["v3", "v2"]
BACKENDS: tuple[Backend, ...] = ("v3", "v2")
DEFAULT_BACKEND: Backend = "v3"
# The backend a job's agents (and the readers of its keys) use unless setup chose another
# (`petctl setup --option store=v2`). etcd 3.5 keeps its v2 and v3 keyspaces apart, so every reader of a
# job's keys must use the backend its agents write with: it travels in `JobSpec.etcd_store`.
JOB_DEFAULT_BACKEND: Backend = DEFAULT_BACKEND


class StoreError(Exception):
    """Base of what a store call raises."""


class StoreUnavailable(StoreError):
    """The store could not answer: down, frozen, no leader, a partition, a timeout, every member failed.
    The call may or may not have taken effect (a write that timed out may have landed): callers retry
    on their own schedule and re-read before they decide."""


class StoreDenied(StoreError):
    """The store refused on purpose: no permission on that key (another job's prefix), or a client
    certificate that authenticates as nobody. Retrying does not help."""


class LeaseExpired(StoreError):
    """A keep-alive found the lease gone: its TTL ran out (the holder was silent too long) or it was
    revoked. Every key written under it is gone; the holder must grant a new lease and write again."""


class Compacted(StoreError):
    """A watch asked for history the store no longer keeps (v3 compaction; v2's 1,000-event window).
    The watcher re-reads the directory (`list`) and watches again from that listing's revision + 1."""

    def __init__(self, oldest: int) -> None:
        super().__init__(f"revisions before {oldest} were compacted")
        self.oldest = oldest


@dataclass(frozen=True)
class Entry:
    """One key as the store holds it. `mod_revision` is what a compare-and-swap names; `lease` is the
    id of the lease the key lives under (0: none)."""

    key: str
    value: str
    mod_revision: int
    create_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Liveness:
    """What one read tells a peer of a leased key's holder (`Store.liveness`).

    `quiet` is how long the store itself has received no keep-alive for the key's lease: a lower bound,
    in whole seconds, measured on the store's clock (v3: the lease's remaining time to live, which etcd
    reports truncated to whole seconds, against the TTL it granted). None where one read cannot tell: v2,
    whose keep-alive rewrites the key instead, so `mod_revision` moves with every keep-alive and a
    watcher times how long it stays put (petctl/agent/liveness.py)."""

    mod_revision: int
    lease: int
    quiet: float | None


@dataclass(frozen=True)
class Listing:
    """Every key under a directory, sorted by key, and the store's revision when it was read."""

    entries: tuple[Entry, ...]
    revision: int

    def values(self) -> dict[str, str]:
        """key → value."""
        return {e.key: e.value for e in self.entries}

    def leaves(self, directory: str) -> dict[str, Entry]:
        """The entries by their key relative to `directory` (`live/nodes` → {"a": ..., "b": ...})."""
        base = directory.rstrip("/") + "/"
        return {e.key[len(base):]: e for e in self.entries if e.key.startswith(base)}


@dataclass(frozen=True)
class Event:
    """A change seen by a watch: a put (`value` is the new value) or a delete (`value` is None; an
    expired lease or TTL deletes too). `revision` is the change's."""

    kind: Literal["put", "delete"]
    key: str
    value: str | None
    revision: int


@dataclass(frozen=True)
class Batch:
    """What one wait on a watch returned: the events in revision order (empty when the wait timed out)
    and the revision the watch has seen up to, so the next wait resumes after it."""

    events: tuple[Event, ...]
    revision: int


class Lease(Protocol):
    """A lease granted by `Store.grant`. Keys written with it vanish when it expires or is revoked."""

    @property
    def id(self) -> int: ...

    @property
    def ttl(self) -> float:
        """The TTL it was granted with, in seconds: etcd v3 raises one below its minimum (2 s with
        etcd's default heartbeat and election ticks) to that minimum."""
        ...

    def keepalive(self) -> None:
        """Renew the lease for another `ttl`. Raises LeaseExpired (it is gone) or StoreUnavailable."""
        ...

    def revoke(self) -> None:
        """End it now: every key under it is deleted at once (a clean leave). A lease already gone is
        not an error. Raises StoreUnavailable."""
        ...


class Watch(Protocol):
    """A watch on a directory from a revision. One thread waits on it at a time."""

    @property
    def requests(self) -> int:
        """Requests it has sent etcd so far: v2, one per long poll; v3, one per stream it opened
        (reconnects included), whose events then come without asking. What callers count as its cost."""
        ...

    def wait(self, timeout: float) -> Batch:
        """The next events (at least one), or an empty batch after `timeout` seconds. Raises Compacted
        (re-list and watch again), StoreUnavailable (the backend already retried the members it
        knows; the caller decides whether to keep waiting) or StoreDenied."""
        ...

    def close(self) -> None:
        """Stop watching; idempotent. Safe from another thread: a `wait` in progress returns within
        1 s, raising StoreUnavailable("watch closed"), as every later `wait` does."""
        ...


class Store(Protocol):
    """Coordination-store operations the agent, the jobview and the providers need; nothing more.

    Every call raises StoreUnavailable when the store cannot answer, and StoreDenied for a key outside
    what this client may touch. A missing key is an answer, not an error (None, False, an empty
    listing). A client is safe to share between threads."""

    backend: Backend

    def get(self, key: str) -> Entry | None:
        """The key, or None when it does not exist."""
        ...

    def list(self, directory: str) -> Listing:
        """Every key under `directory` at any depth, sorted by key (empty when there is none)."""
        ...

    def first_created(self, directory: str, limit: int) -> Listing:
        """The first `limit` keys created under `directory` (lowest `create_revision` first), at any
        depth, and the store's revision. Why: a joiner needs only a round's first join records to know
        that it is not the node that closes the round (agent/rendezvous.py), not one record per node.
        v3 sorts and truncates in etcd, so at most `limit` keys cross the wire; v2 has no such read,
        so it lists the directory whole and keeps the first `limit`. Raises ValueError for a limit
        below 1."""
        ...

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        """Write the key unconditionally (under `lease` when given); returns the write's revision.
        Raises LeaseExpired when `lease` is already gone (as create and replace do)."""
        ...

    def create(self, key: str, value: str, lease: Lease | None = None) -> bool:
        """Write the key only where none exists; False when one already does (another writer won)."""
        ...

    def replace(self, key: str, value: str, mod_revision: int, lease: Lease | None = None) -> bool:
        """Compare-and-swap: write only while the key's `mod_revision` is still the one given; False
        when it changed or is gone."""
        ...

    def delete(self, key: str, mod_revision: int | None = None) -> bool:
        """Delete the key (only while its `mod_revision` is the one given, when given); False when it
        did not exist or had changed."""
        ...

    def delete_dir(self, directory: str) -> int:
        """Delete every key under `directory`; how many there were."""
        ...

    def liveness(self, key: str, known: Liveness | None = None) -> Liveness | None:
        """What a peer can tell of the key's holder from one read (`Liveness`); None when the key (or,
        on v3, its lease) is gone. `known`: this key's previous answer. On v3 only its lease is asked
        about then (one LeaseTimeToLive, not the key and then the lease: a holder that writes its key
        again does so under a new lease, and the old one reads as gone); neither is a raft proposal."""
        ...

    def expire(self, key: str, mod_revision: int) -> bool:
        """End the hold on a silent peer's key, as its lease's expiry would: v3 revokes the key's lease
        (every key under it goes, and the holder's next keep-alive raises LeaseExpired); v2 deletes the
        key (the holder's next refresh finds it gone and raises LeaseExpired). Only while the key's
        `mod_revision` is the one given; False when it changed or is gone."""
        ...

    def grant(self, ttl: float) -> Lease:
        """A new lease that lives `ttl` seconds past its last keep-alive (whole seconds on both
        backends, at least 1; `Lease.ttl` says what the store granted)."""
        ...

    def watch(self, directory: str, start_revision: int) -> Watch:
        """Watch every key under `directory`, from `start_revision` (inclusive; a listing's revision
        + 1 misses nothing)."""
        ...

    def watch_key(self, key: str, start_revision: int) -> Watch:
        """Watch the one key `key` (a key, not a directory: `watch` on it would see only keys beneath
        it), from `start_revision` (inclusive)."""
        ...

    def revision(self, directory: str = "/") -> int:
        """The store's current revision, read through `directory`: a client confined to a prefix (a
        job's agents under etcd auth) may read nothing else, so it names a directory it may read."""
        ...

    def close(self) -> None:
        """Release the connection and any watch still open; idempotent."""
        ...
