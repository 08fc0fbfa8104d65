"""A job's event timeline, from every copy there is, merged and de-duplicated once.

Each copy is incomplete alone: etcd's lives only as long as its TTL and the etcd server; the mirror in
the job's prefix lags by one flush interval and needs the agent to have reached the store; a provider may
keep events of its own (the local reconciler's log). The same event read from two copies counts once
(same time, node and name: `petctl.core.eventlog.dedupe`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from petctl.core.eventlog import dedupe, parse_line
from petctl.core.keys import JobKeys
from petctl.core.store import Store
from petctl.jobview.corrupt import Corrupt
from petctl.jobview.prefix import PrefixReader, chunk_text, chunks


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
