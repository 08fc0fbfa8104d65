"""Prefetch the newest complete checkpoint into this node's cache: `python -m petctl.elastic.prefetch`.

A node joining a running job runs this (through its agent, as a separate process: the agent never
imports petctl.elastic) before it registers, next to warming its workers. Its first resume then reads
local disk instead of the store, so the old members, which stop their workers only once the newcomer is
registered, are not kept waiting for a download. Torch-free: it moves bytes and checks sha256.

Prints one JSON event line (`checkpoint.prefetched` with the step, or null when the store holds none)
and exits 0; a store it cannot read is one `checkpoint.prefetch_failed` line and exit 1 (the resume then
downloads as usual).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from petctl.elastic import manifest as mf
from petctl.elastic.manifest import LocalCache
from petctl.io.eventlog import EventLog
from petctl.io.objstore import ObjectStore as CheckpointStore
from petctl.io.objstore import open_object_store


def prefetch(store: CheckpointStore, cache: LocalCache, log: EventLog) -> int | None:
    """Fetch the newest readable checkpoint into `cache` (skipping corrupt ones, as a resume does);
    its step, or None when the store holds none. Raises what the store raises."""
    t0 = time.monotonic()

    def corrupt(step: int, reason: str) -> None:
        log.emit("checkpoint.skipped_corrupt", step=step, reason=reason, url=store.url)

    for manifest in mf.readable_manifests(store, corrupt):
        found = cache.fetch(store, manifest, corrupt)
        if found is not None:
            log.emit("checkpoint.prefetched", step=manifest.step, source=found[1], bytes=manifest.total_bytes,
                     seconds=round(time.monotonic() - t0, 3), url=store.url)
            return manifest.step
    log.emit("checkpoint.prefetched", step=None, seconds=round(time.monotonic() - t0, 3), url=store.url)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m petctl.elastic.prefetch", description=__doc__)
    parser.add_argument("--url", required=True, help="the job's checkpoint URL (s3://... or file://...)")
    parser.add_argument("--cache-dir", required=True, type=Path, help="the node's cache root")
    args = parser.parse_args(argv)
    log = EventLog("prefetch", stream=sys.stdout)
    try:
        prefetch(open_object_store(args.url), LocalCache(args.url, args.cache_dir), log)
    except (OSError, ValueError) as e:
        log.emit("checkpoint.prefetch_failed", error=f"{type(e).__name__}: {e}", url=args.url)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
