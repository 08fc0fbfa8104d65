"""Read a job's event timeline from wherever it was kept: etcd `events/` and the job prefix mirror.

Both copies are read and merged (the same event appears in both: deduplicated by time, node and name),
because neither is complete alone: etcd's lives only as long as its TTL and the etcd server; the mirror
lags by one flush interval and needs the agent to have reached its prefix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from petctl.core.eventlog import dedupe
from petctl.core.keys import JobKeys


def read_events(job: str, etcd_endpoint: str = "", mirror_url: str = "") -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    if etcd_endpoint:
        events += _from_etcd(job, etcd_endpoint)
    if mirror_url:
        events += _from_mirror(mirror_url)
    return sorted(dedupe(events), key=lambda e: float(e.get("ts", 0.0)))


def _from_etcd(job: str, endpoint: str) -> list[dict[str, Any]]:
    import etcd

    from petctl.io.etcd import etcd_client

    try:
        listing = etcd_client(endpoint, read_timeout=3).read(JobKeys(job).events, recursive=True, sorted=True)
    except (etcd.EtcdKeyNotFound, etcd.EtcdConnectionFailed, etcd.EtcdException):
        return []
    return [r for r in (_loads(leaf.value) for leaf in listing.leaves if leaf.value) if r]


def _from_mirror(url: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for text in _mirror_streams(url):
        out += [r for r in (_loads(line) for line in text.splitlines()) if r]
    return out


def _mirror_streams(url: str) -> list[str]:
    """Each node's events, its chunks reassembled in write order (petctl/core/mirrorchunks.py)."""
    from petctl.core.mirrorchunks import by_node

    u = urlparse(url)
    if u.scheme in ("", "file"):
        root = Path(unquote(u.path))
        if not (root / "events").is_dir():
            return []
        names = [p.relative_to(root).as_posix() for p in (root / "events").rglob("*.jsonl")]
        return [b"".join((root / k.name).read_bytes() for k in keys).decode("utf-8", "replace")
                for keys in by_node(names, "events").values()]
    if u.scheme == "s3":
        import boto3

        s3 = boto3.client("s3")
        base = f"{u.path.lstrip('/').rstrip('/')}/".lstrip("/")
        names = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=u.netloc, Prefix=base + "events/"):
            names += [obj["Key"][len(base):] for obj in page.get("Contents", [])]
        return [b"".join(s3.get_object(Bucket=u.netloc, Key=base + k.name)["Body"].read() for k in keys)
                .decode("utf-8", "replace") for keys in by_node(names, "events").values()]
    return []


def _loads(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) and "event" in value else None
