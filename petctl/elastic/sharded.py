"""Sharded checkpoints (FSDP, DTensor) with torch.distributed.checkpoint on the same store and manifests.

Every rank owns part of the state, so every rank writes: `dcp.save` writes each rank's shards to a
node-local directory (`__<rank>_<n>.distcp`, plus `.metadata` from rank 0), each rank uploads its own
files in the background and then a small `step-<n>/_entries/<rank>.json` naming them; rank 0's uploader
waits for all ranks' entries and only then writes the manifest. The manifest protocol is unchanged, so a
save cut off on any rank is never trusted, and retention and corruption handling are shared with the
one-writer `Checkpointer`.

Resume downloads the newest complete checkpoint once per node (LOCAL_RANK 0; resharded loads read shards
written by any rank), verifies every object, and `dcp.load`s it, so a job that comes back with a
different world size still resumes. No collective of the training's groups runs off the training thread.

Under the petctl agent every rank also keeps its shard, and the previous node's, in node memory
(`ring.py`, on a gloo group of its own, off the training thread): a resume takes the newest step
whose every shard a live rank holds when the store has nothing newer (`resume.py`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from petctl.elastic import manifest as mf
from petctl.elastic.checkpointer import BaseCheckpointer
from petctl.elastic.manifest import LocalCache
from petctl.elastic.snapshots import SnapshotOptions
from petctl.elastic.snapshots.resume import newest_reader
from petctl.elastic.snapshots.ring import ShardSnapshotTier
from petctl.io.eventlog import EventLog
from petctl.io.objstore import ObjectNotFound
from petctl.io.objstore import ObjectStore as CheckpointStore
from petctl.io.procs import wait_until

ENTRIES_POLL = 0.2  # how often rank 0 looks for the other ranks' entries before writing the manifest

DCP_FORMAT = "dcp"
METADATA_FILE = ".metadata"


def entries_prefix(step: int) -> str:
    return mf.data_prefix(step) + "_entries/"


class ShardedCheckpointer(BaseCheckpointer):
    """Like `Checkpointer`, for state that every rank saves a part of. `app_state` is what `dcp.save`
    takes: a dict of tensors/DTensors or `Stateful` objects, e.g. `{"app": ShardedState(model, opt)}`.

    Every call is collective: create it, `resume`, `step_end` and `save` on every rank. `every_seconds`
    saves are agreed on in the save-now check (so at most `check_every - 1` steps late, and it needs
    `check_every >= 1`); the other arguments are `Checkpointer`'s, plus `local_dir` (where DCP writes
    before the upload), `entries_timeout` (how long rank 0 waits for every rank's part) and `snapshots`
    (in-memory shard snapshots, each also kept by the next node: on by default under the petctl agent,
    `False` or PETCTL_SNAPSHOTS=0 switches them off; docs/elastic.md).
    """

    AGREE_ON_TIME = True  # every rank saves: a time-based save is decided together

    def __init__(self, url: str | None = None, keep: int = 3, every: int | str = 0, *,
                 every_seconds: float = 0.0, check_every: int = 1, background: bool = True,
                 local_dir: Path | str | None = None,
                 store: CheckpointStore | None = None, control_dir: Path | str | None = None,
                 entries_timeout: float = 900.0, log: EventLog | None = None,
                 snapshots: SnapshotOptions | bool | None = None) -> None:
        super().__init__(url, keep, every, every_seconds, check_every, background, store, None, control_dir,
                         log)
        self.entries_timeout = entries_timeout
        self.local_dir = Path(local_dir) if local_dir else LocalCache(self.url).dir / "dcp"
        self.snapshots = ShardSnapshotTier(self.comm, self.log, snapshots)  # collective (ring.py)
        self._setup_auto("sharded")

    # --- resume ----------------------------------------------------------------------------------
    def _candidates(self) -> list[int]:
        """Rank 0: steps whose manifest parses and whose objects all exist with the right sizes."""
        out = []
        for manifest in mf.readable_manifests(self.store, self._report_corrupt):
            step = manifest.step
            sizes = {o.key: o.size for o in self.store.list(mf.data_prefix(step))}
            if manifest.meta.get("format") != DCP_FORMAT or any(
                    sizes.get(manifest.key_of(e)) != e.size for e in manifest.objects):
                self.log.emit("checkpoint.skipped_corrupt", step=step, reason="missing or short objects",
                              url=self.url)
                continue
            out.append(step)
        return out

    def _download(self, step: int) -> tuple[bool, str]:
        """Node-local copy of checkpoint `step`, verified; reuses files already there and intact."""
        manifest = mf.read_manifest(self.store, step)
        target = self.local_dir / f"restore-{step:012d}"
        target.mkdir(parents=True, exist_ok=True)
        source = "cache"
        for entry in manifest.objects:
            path = target / entry.name
            if mf.verify_file(path, entry):
                continue
            source = "store"
            self.store.get_file(manifest.key_of(entry), path)
            if not mf.verify_file(path, entry):
                self.log.emit("checkpoint.skipped_corrupt", step=step, object=entry.name,
                              reason="size or sha256 mismatch", url=self.url)
                return False, source
        return True, source

    def resume(self, app_state: dict[str, Any]) -> int:
        """Load the newest sharded state into `app_state`, from the shards in node memory when they hold
        the newest step (resume.py), else from the store; returns the next step (0: none)."""
        t0 = time.monotonic()
        taken = self.snapshots.resume(app_state, newest_reader(
            lambda: next((m.step for m in mf.readable_manifests(self.store, self._report_corrupt)), None),
            self.log, self.url))
        if taken is not None:
            self._submitted_step = taken  # never saved to the store again
            return taken + 1
        failure = None
        candidates: list[int] = []
        if self.comm.is_writer:
            try:
                candidates = self._candidates()
            except Exception as e:  # noqa: BLE001 - whatever failed, the other ranks wait in the broadcast below: they must hear it
                failure = f"{type(e).__name__}: {e}"
        shared = self.comm.broadcast_object(("error", failure) if failure else ("ok", candidates))
        if shared[0] == "error":
            raise RuntimeError(f"resume failed on rank 0: {shared[1]}")
        downloader = self.comm.local_rank == 0
        for step in shared[1]:
            ok, source = True, "peer"
            if downloader:
                try:
                    ok, source = self._download(step)
                except (ObjectNotFound, ValueError) as e:
                    self.log.emit("checkpoint.skipped_corrupt", step=step, reason=repr(e), url=self.url)
                    ok = False
            if self.comm.any_true(not ok):  # also the barrier: the files are in place on every node
                continue
            dcp.load(app_state, checkpoint_id=str(self.local_dir / f"restore-{step:012d}"))
            self._submitted_step = step
            self._clean(keep_restore=step)
            self.log.emit("checkpoint.loaded", step=step, source=source, url=self.url, format=DCP_FORMAT,
                          seconds=round(time.monotonic() - t0, 3))
            return step + 1
        return 0

    # --- saving ----------------------------------------------------------------------------------
    def _step_snapshot(self, step: int, state: dict[str, Any]) -> None:
        self.snapshots.take(step, state)

    def close(self) -> None:
        """Commit the snapshot in flight, then as `BaseCheckpointer.close`."""
        self.snapshots.close()
        super().close()

    def _save_for_save_now(self, step: int, app_state: dict[str, Any]) -> bool:
        """Every rank saves its part synchronously; True once every part (rank 0: and the manifest) is
        up, on every rank."""
        ok = self.save(step, app_state, block=True)
        return not self.comm.any_true(not ok)

    def save(self, step: int, app_state: dict[str, Any], block: bool = False) -> bool:
        """Every rank: write its shards locally now (collective), upload them in the background.

        With `block`, returns whether this rank's part (rank 0: the whole checkpoint) is complete.
        """
        if step == self._submitted_step:
            return self._uploader.wait() is True if block else True
        self._uploader.wait()  # the previous upload finishes before its local files are replaced
        local = self.local_dir / f"save-{step:012d}"
        if self.comm.is_writer:  # entries left by an earlier attempt at this step must not count
            self.store.delete([o.key for o in self.store.list(entries_prefix(step))])
        if self.comm.local_rank == 0:
            shutil.rmtree(local, ignore_errors=True)
        # dcp.save starts with a collective, so the deletes above happen before any rank writes, and
        # every rank has finished its previous upload before anyone cleans the older directories below.
        dcp.save(app_state, checkpoint_id=str(local))
        if self.comm.local_rank == 0:
            for old in self.local_dir.glob("save-*"):
                if old != local:
                    shutil.rmtree(old, ignore_errors=True)
        rank = self.comm.rank
        mine = {p.name: p for p in local.iterdir()
                if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == METADATA_FILE)}
        self._saved_now(step)
        self._uploader.submit(lambda: self._upload(step, local, mine))
        return self._uploader.wait() is True if block else True

    def _upload(self, step: int, local: Path, files: dict[str, Path]) -> bool:
        """Background thread: this rank's shards and entries, then (rank 0) the manifest. False when
        this node is fenced (workerprotocol.py): a fenced rank uploads nothing, and rank 0 fenced at the
        commit writes no manifest (a fenced other rank leaves rank 0 waiting for its entries until
        `entries_timeout`: that round is being replaced anyway). Raises what the store raises."""
        t0 = time.monotonic()
        try:
            if self.fence.blocks(step, "upload"):
                return False
            entries = mf.describe_files(files)
            for entry in entries:
                self.store.put_file(mf.data_prefix(step) + entry.name, files[entry.name])
            self.store.put_bytes(f"{entries_prefix(step)}{self.comm.rank}.json",
                                 json.dumps([[e.name, e.size, e.sha256] for e in entries]).encode())
            if self.comm.is_writer:
                manifest = self._write_manifest(step)
                if manifest is None:
                    return False
                pruned = self._prune(step)
                self.log.emit("checkpoint.saved", step=step, bytes=manifest.total_bytes, url=self.url,
                              seconds=round(time.monotonic() - t0, 3), format=DCP_FORMAT, pruned=pruned)
            return True
        finally:
            for path in files.values():  # only our own files: other local ranks may still be uploading
                path.unlink(missing_ok=True)

    def _write_manifest(self, step: int) -> mf.Manifest | None:
        """Rank 0's uploader: wait for every rank's entries, then make the checkpoint visible (None:
        fenced at the last moment, nothing visible). Raises TimeoutError when a rank's part is missing."""
        timeout = self.entries_timeout
        save_deadline = self.monitor.deadline() if self.monitor.fired_at is not None else None
        if save_deadline is not None:  # past it the round re-forms, or the instance is gone
            timeout = max(1.0, min(timeout, save_deadline - time.time()))
        prefix = entries_prefix(step)
        world = self.comm.world_size
        keys = wait_until(lambda: _all_entries(self.store, prefix, world), timeout, ENTRIES_POLL)
        if not keys:
            raise TimeoutError(f"step {step}: {len(self.store.list(prefix))}/{world} ranks uploaded")
        objects = []
        for key in sorted(keys):
            objects += [mf.ObjectEntry(n, int(s), h) for n, s, h in json.loads(self.store.get_bytes(key))]
        manifest = mf.Manifest(step=step, objects=objects,
                               meta={"format": DCP_FORMAT, "world_size": self.comm.world_size})
        if self.fence.blocks(step, "commit"):
            return None
        self.store.put_bytes(mf.manifest_key(step), manifest.to_json().encode())
        return manifest

    def _clean(self, keep_restore: int) -> None:
        if self.comm.local_rank != 0 or not self.local_dir.is_dir():
            return
        for path in self.local_dir.glob("restore-*"):
            if path.name != f"restore-{keep_restore:012d}":
                shutil.rmtree(path, ignore_errors=True)


def _all_entries(store: CheckpointStore, prefix: str, world_size: int) -> list[str]:
    """The entries objects under `prefix` once every rank's is there, else [] (keep waiting)."""
    keys = [o.key for o in store.list(prefix)]
    return keys if len(keys) >= world_size else []
