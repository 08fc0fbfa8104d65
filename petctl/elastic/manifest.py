"""Atomic checkpoints on a dumb object store: data first, then a small manifest that names it.

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
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from petctl.elastic.store import CheckpointStore, ObjectNotFound

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

    `may_commit()` is asked between the two (a fence, see fence.py): False leaves the data without a
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
