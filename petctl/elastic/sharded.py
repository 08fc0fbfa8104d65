"""Sharded checkpoints (FSDP, DTensor) with torch.distributed.checkpoint on the same store and manifests.

Every rank owns part of the state, so every rank writes: `dcp.save` writes each rank's shards to a
node-local directory (`__<rank>_<n>.distcp`, plus `.metadata` from rank 0), each rank uploads its own
files in the background and then a small `step-<n>/_entries/<rank>.json` naming them; rank 0's uploader
waits for all ranks' entries and only then writes the manifest. The manifest protocol is unchanged, so a
save cut off on any rank is never trusted, and retention and corruption handling are shared with the
one-writer `Checkpointer`.

Resume downloads the newest complete checkpoint once per node (LOCAL_RANK 0; resharded loads read shards
written by any rank), verifies every object, and `dcp.load`s it, so a job that comes back with a
different world size still resumes. No collective runs off the training thread.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from petctl.core.eventlog import EventLog
from petctl.elastic import manifest as mf
from petctl.elastic.background import BackgroundUploader, UploaderOwner
from petctl.elastic.cache import LocalCache
from petctl.elastic.checkpointer import ENV_CHECKPOINT_URL
from petctl.elastic.dist import Comm
from petctl.elastic.preemption import PreemptionMonitor
from petctl.elastic.store import CheckpointStore, ObjectNotFound, open_store

DCP_FORMAT = "dcp"
METADATA_FILE = ".metadata"


def entries_prefix(step: int) -> str:
    return mf.data_prefix(step) + "_entries/"


class ShardedState:
    """A DCP `Stateful` for a (possibly FSDP-wrapped) model and optimizer plus plain extras.

    `get_state_dict`/`set_state_dict` give sharded state dicts for FSDP and plain ones otherwise.
    """

    def __init__(self, model: Any, optimizer: Any = None, extra: dict[str, Any] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra = extra if extra is not None else {}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optimizers = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        return {"model": model_sd, "optim": optim_sd, "extra": dict(self.extra)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"] if optimizers else {})
        self.extra.update(state_dict.get("extra", {}))


class ShardedCheckpointer(UploaderOwner):
    """Like `Checkpointer`, for state that every rank saves a part of. `app_state` is what `dcp.save`
    takes: a dict of tensors/DTensors or `Stateful` objects, e.g. `{"app": ShardedState(model, opt)}`.

    Every call is collective: create it, `resume`, `step_end` and `save` on every rank.
    """

    def __init__(self, url: str | None = None, keep: int = 3, every: int = 0, *, check_every: int = 1,
                 background: bool = True, local_dir: Path | str | None = None,
                 store: CheckpointStore | None = None, control_dir: Path | str | None = None,
                 entries_timeout: float = 900.0, log: EventLog | None = None) -> None:
        url = url or (store.url if store is not None else os.environ.get(ENV_CHECKPOINT_URL, ""))
        if not url:
            raise ValueError(f"no checkpoint URL: pass url= or set ${ENV_CHECKPOINT_URL}")
        self.url = url
        self.keep = keep
        self.every = every
        self.background = background
        self.entries_timeout = entries_timeout
        self.comm = Comm.create()
        self.log = log or EventLog("elastic", rank=self.comm.rank, node_id=os.environ.get("PETCTL_NODE_ID"))
        self.local_dir = Path(local_dir) if local_dir else LocalCache(url).dir / "dcp"
        self.preemption = PreemptionMonitor(comm=self.comm, check_every=check_every,
                                            **({"control_dir": Path(control_dir)} if control_dir else {}))
        self.preemption.announce()
        self._store = store
        self._uploader = BackgroundUploader(on_error=lambda e: self.log.emit(
            "checkpoint.save_failed", error=repr(e), url=self.url))
        self._submitted_step: int | None = None
        self.preempted_at: int | None = None

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            self._store = open_store(self.url)
        return self._store

    # --- resume ----------------------------------------------------------------------------------
    def _candidates(self) -> list[int]:
        """Rank 0: steps whose manifest parses and whose objects all exist with the right sizes."""
        out = []
        for manifest in mf.readable_manifests(self.store, lambda step, reason: self.log.emit(
                "checkpoint.skipped_corrupt", step=step, reason=reason, url=self.url)):
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
        """Load the newest complete sharded checkpoint into `app_state`; returns the next step (0: none)."""
        t0 = time.monotonic()
        failure = None
        candidates: list[int] = []
        if self.comm.is_writer:
            try:
                candidates = self._candidates()
            except Exception as e:
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
    def should_checkpoint(self, step: int) -> bool:
        return self.preemption.should_checkpoint(step)

    def step_end(self, step: int, app_state: dict[str, Any]) -> bool:
        """As `Checkpointer.step_end`: periodic saves, and True after the preemption save of `step`."""
        if self.preempted_at is not None:
            return True
        if self.should_checkpoint(step):
            ok = self.save(step, app_state, block=True)
            ok = not self.comm.any_true(not ok)  # every rank's part is up (rank 0: and the manifest)
            if ok:
                self.preemption.report_saved(step)
            self.log.emit("preempt.saved" if ok else "preempt.save_failed", step=step)
            self.preempted_at = step
            return True
        if self.every > 0 and (step + 1) % self.every == 0:
            self.save(step, app_state, block=not self.background)
        return False

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
        self._submitted_step = step
        self._uploader.submit(lambda: self._upload(step, local, mine))
        return self._uploader.wait() is True if block else True

    def _upload(self, step: int, local: Path, files: dict[str, Path]) -> bool:
        t0 = time.monotonic()
        entries = mf.describe_files(files)
        for entry in entries:
            self.store.put_file(mf.data_prefix(step) + entry.name, files[entry.name])
        self.store.put_bytes(f"{entries_prefix(step)}{self.comm.rank}.json",
                             json.dumps([[e.name, e.size, e.sha256] for e in entries]).encode())
        if self.comm.is_writer:
            manifest = self._write_manifest(step)
            try:  # the checkpoint is complete: housekeeping failures must not fail the save
                pruned = mf.prune(self.store, self.keep)
            except Exception as e:
                pruned = []
                self.log.emit("checkpoint.prune_failed", step=step, error=repr(e), url=self.url)
            self.log.emit("checkpoint.saved", step=step, bytes=manifest.total_bytes, url=self.url,
                          seconds=round(time.monotonic() - t0, 3), format=DCP_FORMAT, pruned=pruned)
        for path in files.values():  # only our own files: other local ranks may still be uploading
            path.unlink(missing_ok=True)
        return True

    def _write_manifest(self, step: int) -> mf.Manifest:
        """Rank 0's uploader: wait for every rank's entries, then make the checkpoint visible."""
        timeout = self.entries_timeout
        preempt_deadline = self.preemption.deadline() if self.preemption.fired_at is not None else None
        if preempt_deadline is not None:  # past the notice's deadline the instance is gone anyway
            timeout = max(1.0, min(timeout, preempt_deadline - time.time()))
        deadline = time.monotonic() + timeout
        prefix = entries_prefix(step)
        while True:
            keys = [o.key for o in self.store.list(prefix)]
            if len(keys) >= self.comm.world_size:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}: {len(keys)}/{self.comm.world_size} ranks uploaded")
            time.sleep(0.2)
        objects = []
        for key in sorted(keys):
            objects += [mf.ObjectEntry(n, int(s), h) for n, s, h in json.loads(self.store.get_bytes(key))]
        manifest = mf.Manifest(step=step, objects=objects,
                               meta={"format": DCP_FORMAT, "world_size": self.comm.world_size})
        self.store.put_bytes(mf.manifest_key(step), manifest.to_json().encode())
        return manifest

    def _clean(self, keep_restore: int) -> None:
        if self.comm.local_rank != 0 or not self.local_dir.is_dir():
            return
        for path in self.local_dir.glob("restore-*"):
            if path.name != f"restore-{keep_restore:012d}":
                shutil.rmtree(path, ignore_errors=True)
