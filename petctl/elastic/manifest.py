"""The durable checkpoint in the object store (manifest, objects, pruning) and its node-local copy
(`LocalCache`).

Atomic checkpoints on a dumb object store: data first, then a small manifest that names it.

Layout under the checkpoint URL:

    step-000000000120/state.pt        data objects of step 120 (any number of files)
    manifest-000000000120.json        {"format", "step", "created", "objects": [{"name","size","sha256"}]}

A writer uploads every data object, then the manifest; the manifest is a single small PUT, which S3 and a
rename make atomic. A reader trusts only manifests and checks each object's size and sha256 before use, so
a save cut off half way (data without manifest) or a damaged object (hash mismatch) is never loaded; the
next older manifest wins instead. Retention deletes a manifest before its data, so no manifest ever
names data that is already gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from petctl.io import procs
from petctl.io.objstore import ObjectNotFound
from petctl.io.objstore import ObjectStore as CheckpointStore

FORMAT = 1
MANIFEST_RE = re.compile(r"^manifest-(\d{12})\.json$")
DATA_RE = re.compile(r"^step-(\d{12})/")


def manifest_key(step: int) -> str:
    return f"manifest-{step:012d}.json"


def data_prefix(step: int) -> str:
    return f"step-{step:012d}/"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class ObjectEntry:
    name: str  # file name inside the step's data prefix
    size: int
    sha256: str


@dataclass
class Manifest:
    step: int
    objects: list[ObjectEntry]
    created: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)  # writer's notes (world size, torch version)
    format: int = FORMAT

    def key_of(self, entry: ObjectEntry) -> str:
        return data_prefix(self.step) + entry.name

    def entry(self, name: str) -> ObjectEntry:
        for e in self.objects:
            if e.name == name:
                return e
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.objects)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Strict parse: anything malformed raises ValueError, which readers treat as corrupt."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a petctl manifest (or an unknown format)")
        try:
            objects = [ObjectEntry(str(o["name"]), int(o["size"]), str(o["sha256"])) for o in data["objects"]]
            return cls(step=int(data["step"]), objects=objects, created=float(data.get("created", 0.0)),
                       meta=dict(data.get("meta") or {}))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed manifest: {e}") from e


def describe_files(files: dict[str, Path]) -> list[ObjectEntry]:
    """Sizes and hashes of the local files about to be uploaded (computed once, by the writer)."""
    return [ObjectEntry(name, path.stat().st_size, sha256_file(path)) for name, path in sorted(files.items())]


def verify_file(path: Path, entry: ObjectEntry) -> bool:
    """Size first (cheap), then the hash: a truncated or altered object fails one of them."""
    try:
        if path.stat().st_size != entry.size:
            return False
    except FileNotFoundError:
        return False
    return sha256_file(path) == entry.sha256


def write_checkpoint(store: CheckpointStore, step: int, files: dict[str, Path],
                     meta: dict[str, Any] | None = None,
                     entries: list[ObjectEntry] | None = None,
                     may_commit: Callable[[], bool] | None = None) -> Manifest | None:
    """Upload the data objects, then the manifest. Only the last PUT makes the checkpoint visible.

    `may_commit()` is asked between the two (a fence, see workerprotocol.py): False leaves the data without a
    manifest (never loaded, pruned later) and returns None. Raises what the store raises.
    """
    manifest = Manifest(step=step, objects=entries or describe_files(files), meta=dict(meta or {}))
    for entry in manifest.objects:
        store.put_file(manifest.key_of(entry), files[entry.name])
    if may_commit is not None and not may_commit():
        return None
    store.put_bytes(manifest_key(step), manifest.to_json().encode())
    return manifest


def manifest_steps(store: CheckpointStore) -> list[int]:
    """Steps that have a manifest, newest first (a manifest may still turn out corrupt)."""
    steps = []
    for obj in store.list("manifest-"):
        m = MANIFEST_RE.match(obj.key)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def read_manifest(store: CheckpointStore, step: int) -> Manifest:
    """Raises ObjectNotFound or ValueError (corrupt)."""
    manifest = Manifest.from_json(store.get_bytes(manifest_key(step)))
    if manifest.step != step:
        raise ValueError(f"manifest for step {step} names step {manifest.step}")
    return manifest


def readable_manifests(store: CheckpointStore, on_corrupt: Callable[[int, str], None]) -> Iterator[Manifest]:
    """Manifests newest first. One that is gone or does not parse goes to `on_corrupt(step, reason)` and
    is skipped: a resume must fall back to an older checkpoint, never fail on a damaged newest one."""
    for step in manifest_steps(store):
        try:
            manifest = read_manifest(store, step)
        except (ValueError, ObjectNotFound) as e:
            on_corrupt(step, f"manifest: {e}")
            continue
        yield manifest


def prune(store: CheckpointStore, keep: int) -> list[int]:
    """Keep the newest `keep` manifests and their data; delete older ones and orphaned older data.

    Data newer than the newest kept manifest is left alone: it may be an upload still in flight.
    Returns the deleted steps.
    """
    if keep < 1:
        return []
    objects = store.list()
    manifests = sorted((int(m.group(1)) for o in objects if (m := MANIFEST_RE.match(o.key))), reverse=True)
    kept = set(manifests[:keep])
    if not kept:
        return []
    oldest_kept = min(kept)
    doomed = [s for s in manifests if s not in kept]
    if doomed:  # manifests first: a reader must never find a manifest whose data is half deleted
        store.delete([manifest_key(s) for s in doomed])
    data_keys: list[str] = []
    doomed_data: set[int] = set()
    for obj in objects:
        m = DATA_RE.match(obj.key)
        if m and int(m.group(1)) not in kept and int(m.group(1)) < oldest_kept:
            data_keys.append(obj.key)
            doomed_data.add(int(m.group(1)))
    if data_keys:
        store.delete(data_keys)
    return sorted(set(doomed) | doomed_data)


# --- the node-local cache (LocalCache) ----------------------------------------------------------------------
# A node-local copy of the newest checkpoint this node wrote or read.
#
# A restart on the same node (the common case after a worker failure or a peer's preemption) then loads
# from local disk instead of downloading the whole state again. The cache is only a hint: an entry is used
# only when its manifest equals the store's newest valid one and every file's size and sha256 verify.
#
#     <cache>/<id of the checkpoint URL>/step-<n>/<files>     the newest checkpoint
#     <cache>/<id>/staging-<n>-<pid>/<files>                  a save or download in progress


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
