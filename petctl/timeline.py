"""Read a job's event timeline from wherever it was kept: etcd `events/` and the job prefix mirror.

Both copies are read and merged (the same event appears in both: deduplicated by time, node and name),
because neither is complete alone: etcd's lives only as long as its TTL and the etcd server; the mirror
lags by one flush interval and needs the agent to have reached its prefix. The mirror is read through
the object store (`petctl.io.objstore`), the same code for `file://` and `s3://`.
"""

from __future__ import annotations

import json
from typing import Any

from petctl.core.eventlog import dedupe
from petctl.core.keys import JobKeys
from petctl.core.mirrorchunks import by_node
from petctl.io.objstore import ObjectStore, open_store


def read_events(job: str, etcd_endpoint: str = "", mirror_url: str = "",
                mirror: ObjectStore | None = None) -> list[dict[str, Any]]:
    """The job's events, sorted by time. `mirror` is the job's prefix as a store (the AWS provider passes
    one built on its session, which knows the user's profile and region); else one is opened on
    `mirror_url`. Raises OSError when the mirror cannot be read (etcd being unreachable is not an error:
    its copy is then left out)."""
    events: list[dict[str, Any]] = []
    if etcd_endpoint:
        events += _from_etcd(job, etcd_endpoint)
    if mirror is None and mirror_url:
        mirror = open_store(mirror_url)
    if mirror is not None:
        events += mirror_events(mirror)
    return sorted(dedupe(events), key=lambda e: float(e.get("ts", 0.0)))


def _from_etcd(job: str, endpoint: str) -> list[dict[str, Any]]:
    import etcd

    from petctl.io.etcd import etcd_client

    try:
        listing = etcd_client(endpoint, read_timeout=3).read(JobKeys(job).events, recursive=True, sorted=True)
    except (etcd.EtcdKeyNotFound, etcd.EtcdConnectionFailed, etcd.EtcdException):
        return []
    return [r for r in (_loads(leaf.value) for leaf in listing.leaves if leaf.value) if r]


def mirror_events(store: ObjectStore) -> list[dict[str, Any]]:
    """Every event the agents mirrored under `store` (each node's chunks reassembled in write order,
    petctl/core/mirrorchunks.py), unsorted across nodes."""
    names = [o.key for o in store.list("events/")]
    out: list[dict[str, Any]] = []
    for keys in by_node(names, "events").values():
        # Concatenated before decoding: a chunk may end inside a multi-byte character.
        text = b"".join(store.get_bytes(k.name) for k in keys).decode("utf-8", "replace")
        out += [r for r in (_loads(line) for line in text.splitlines()) if r]
    return out


def _loads(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) and "event" in value else None
