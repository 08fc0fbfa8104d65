"""A node-local copy of the newest checkpoint this node wrote or read.

A restart on the same node (the common case after a worker failure or a peer's preemption) then loads
from local disk instead of downloading the whole state again. The cache is only a hint: an entry is used
only when its manifest equals the store's newest valid one and every file's size and sha256 verify.

    <cache>/<id of the checkpoint URL>/step-<n>/<files>     the newest checkpoint
    <cache>/<id>/staging-<n>-<pid>/<files>                  a save or download in progress
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from petctl.elastic.manifest import Manifest, verify_file
from petctl.elastic.store import CheckpointStore, ObjectNotFound
from petctl.io import procs

ENV_CACHE_DIR = "PETCTL_CACHE_DIR"


def default_cache_root() -> Path:
    """$PETCTL_CACHE_DIR, else a directory under the system temp dir (on the node's local disk)."""
    value = os.environ.get(ENV_CACHE_DIR, "")
    return Path(value) if value else Path(tempfile.gettempdir()) / "petctl-cache"


class LocalCache:
    """Holds at most one committed checkpoint per checkpoint URL, plus in-progress staging dirs."""

    def __init__(self, url: str, root: Path | None = None) -> None:
        url_id = hashlib.sha256(url.encode()).hexdigest()[:16]
        self.dir = (root or default_cache_root()) / url_id

    def staging(self, step: int) -> Path:
        """A fresh directory to write a checkpoint's files into before it is committed."""
        path = self.dir / f"staging-{step:012d}-{os.getpid()}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def committed(self, step: int) -> Path:
        return self.dir / f"step-{step:012d}"

    def commit(self, staging: Path, step: int) -> Path:
        """Make `staging` the cached checkpoint of `step` and forget every other one."""
        dest = self.committed(step)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
        for other in self.dir.glob("step-*"):
            if other != dest:
                shutil.rmtree(other, ignore_errors=True)
        return dest

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def sweep(self) -> list[Path]:
        """Remove staging dirs of processes that died mid-save (a killed worker leaves a whole state)."""
        removed = []
        for path in self.dir.glob("staging-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not procs.alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    def lookup(self, manifest: Manifest) -> Path | None:
        """The cached directory holding exactly this manifest's objects, verified, or None."""
        path = self.committed(manifest.step)
        if not path.is_dir():
            return None
        for entry in manifest.objects:
            if not verify_file(path / entry.name, entry):
                shutil.rmtree(path, ignore_errors=True)  # stale or damaged: never trust it again
                return None
        return path


    def fetch(self, store: CheckpointStore, manifest: Manifest,
              on_corrupt: Callable[[int, str], None]) -> tuple[Path, str] | None:
        """A local directory holding the manifest's verified objects, and where they came from: this
        cache (`cache`), else a download into it (`store`). None when an object is missing or does not
        verify (reported to `on_corrupt(step, reason)`, the partial download discarded). Raises what the
        store raises for anything else (StoreError, OSError)."""
        cached = self.lookup(manifest)
        if cached is not None:
            return cached, "cache"
        staging = self.staging(manifest.step)
        try:
            for entry in manifest.objects:
                target = staging / entry.name
                store.get_file(manifest.key_of(entry), target)
                if not verify_file(target, entry):
                    on_corrupt(manifest.step, f"{entry.name}: size or sha256 mismatch")
                    self.discard(staging)
                    return None
        except ObjectNotFound as e:
            on_corrupt(manifest.step, f"missing object {e}")
            self.discard(staging)
            return None
        except BaseException:
            self.discard(staging)
            raise
        return self.commit(staging, manifest.step), "store"
