"""A job's prefix as the read side sees it: named objects it can list and read, and what the read side
makes of them: each node's log, followed chunk by chunk, and the job's event timeline merged from every
copy there is; with a count of the records it had to skip.

The agents mirror each node's status, events and log there, and the job's result lands there too
(layout in petctl/agent/reporting.py); it outlives etcd, the instances and (on AWS) the job's stack.
Providers hand the read side a `PrefixReader`: the AWS provider its S3 `JobStore` (bound to the
provider's session, so region, profile and endpoint are the user's), the local provider a
`StorePrefix` on the job's directory (petctl.io.objstore's file store).

Events: each copy is incomplete alone. etcd's lives only as long as its TTL and the etcd server; the
mirror in the job's prefix lags by one flush interval and needs the agent to have reached the store; a
provider may keep events of its own (the local reconciler's log). The same event read from two copies
counts once (same time, node and name: `petctl.core.eventlog.dedupe`).

Skipped records (`Corrupt`): a record another agent wrote half-way, by an incompatible version, or by
hand must never crash `petctl status`; but a skipped record is a fact the user should see, so each one is
counted by kind and the first error of each kind is kept for the message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from petctl.core.eventlog import dedupe, parse_line
from petctl.core.keys import JobKeys
from petctl.core.mirrorchunks import ChunkKey, by_node
from petctl.core.store import Store
from petctl.io.objstore import FileStore, ObjectNotFound, ObjectStore


@dataclass
class Corrupt:
    """Records skipped because they did not parse: kind -> count, and the first error of each kind."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, kind: str, error: object) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.first.setdefault(kind, str(error))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def note(self) -> str:
        """One line for people ("" when nothing was skipped)."""
        if not self.counts:
            return ""
        kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.counts.items()))
        example = next(iter(self.first.values()))
        return f"skipped {self.total} corrupt record(s) ({kinds}); first: {example}"

    def to_dict(self) -> dict[str, int]:
        return dict(self.counts)


class PrefixReader(Protocol):
    """Read-only access to the objects under one job's prefix (names relative to the prefix)."""

    def get_bytes(self, name: str) -> bytes | None:
        """The object's bytes, or None when there is no such object. Raises PetctlError when the store
        cannot be read."""
        ...

    def list_keys(self, sub: str) -> list[str]:
        """Every object name under `<sub>/` (nested ones included), relative to the prefix, sorted."""
        ...


@dataclass(frozen=True)
class StorePrefix:
    """Any object store (petctl.io.objstore: `file://` or `s3://`) as a job prefix: the local provider's
    mirror directory, or an `s3://` URL opened without a provider session."""

    store: ObjectStore

    def get_bytes(self, name: str) -> bytes | None:
        try:
            return self.store.get_bytes(name)
        except ObjectNotFound:
            return None

    def list_keys(self, sub: str) -> list[str]:
        return [o.key for o in self.store.list(f"{sub}/")]


def file_prefix(root: Path) -> StorePrefix:
    """The job prefix in a local directory (the local provider's mirror)."""
    return StorePrefix(FileStore(root))


def chunks(reader: PrefixReader, stream: str) -> dict[str, list[ChunkKey]]:
    """node -> its `events` or `logs` chunks in write order (petctl/core/mirrorchunks.py)."""
    return by_node(reader.list_keys(stream), stream)


def chunk_text(reader: PrefixReader, keys: list[ChunkKey]) -> str:
    """One node's stream, reassembled: its chunks' bytes concatenated in write order, then decoded (a
    chunk may end inside a multi-byte character)."""
    return b"".join(reader.get_bytes(key.name) or b"" for key in keys).decode("utf-8", "replace")


# --- node logs

def log_nodes(reader: PrefixReader) -> list[str]:
    """The nodes that have mirrored a log so far."""
    return list(chunks(reader, "logs"))


def follow_chunks(reader: PrefixReader, node: str | None, follow: bool, running: Callable[[], bool],
                  interval: float) -> Iterator[str]:
    """The node logs' lines from their chunks, in order (prefixed `[node] ` unless one node was asked for).

    Each chunk is fetched once, even with `follow`; a line split across two chunks is joined. With
    `follow`, new chunks (and new nodes) are read every `interval` seconds until `running()` is False.
    """
    nodes = [node] if node else log_nodes(reader)
    seen: dict[str, set[ChunkKey]] = {}  # node -> chunks already shown
    partial: dict[str, str] = {}  # node -> the unterminated tail of its last chunk
    while True:
        listed = chunks(reader, "logs")
        for n in nodes:
            new = [k for k in listed.get(n, []) if k not in seen.setdefault(n, set())]
            seen[n].update(new)
            lines = (partial.pop(n, "") + chunk_text(reader, new)).split("\n")
            partial[n] = lines.pop()  # "" when the text ended with a newline
            for line in (raw.rstrip("\r") for raw in lines):
                yield line if node else f"[{n}] {line}"
        if not follow or not running():
            for n, rest in partial.items():
                if rest:
                    yield rest if node else f"[{n}] {rest}"
            return
        time.sleep(interval)
        nodes = [node] if node else log_nodes(reader)


# --- the event timeline

def merge(*copies: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every copy's events as one timeline: de-duplicated, sorted by time."""
    events = [e for copy in copies for e in copy]
    return sorted(dedupe(events), key=lambda e: float(e.get("ts", 0.0)))


def _record(text: str, corrupt: Corrupt | None) -> dict[str, Any] | None:
    record = parse_line(text)
    if record is None and text.strip() and corrupt is not None:
        corrupt.add("event", f"not an event: {text.strip()[:120]!r}")
    return record


def etcd_events(store: Store, job: str, corrupt: Corrupt | None = None) -> list[dict[str, Any]]:
    """The events still in etcd (`events/`, each under its writer's lease), in key order (each key
    starts with its write time: `JobKeys.event`). Raises StoreError when etcd fails."""
    entries = store.list(JobKeys(job).events).entries
    return [r for entry in entries if entry.value and (r := _record(entry.value, corrupt))]


def mirror_events(reader: PrefixReader, corrupt: Corrupt | None = None) -> list[dict[str, Any]]:
    """Every event the agents mirrored to the job's prefix (each node's chunks in write order)."""
    out = []
    for keys in chunks(reader, "events").values():
        out += [r for line in chunk_text(reader, keys).splitlines() if (r := _record(line, corrupt))]
    return out
