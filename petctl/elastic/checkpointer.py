"""`Checkpointer`: resume in one call, periodic saves in the background, a clean exit on preemption.

    state = State(model=model, optimizer=opt, scheduler=sched, extra={"step": 0})
    ckpt = Checkpointer(keep=3, every=50)            # URL from $PETCTL_CHECKPOINT_URL
    start = ckpt.resume(state)                       # next step to run (0 on a fresh start)
    for step in range(start, total):
        train_step()
        if ckpt.step_end(step, state):               # preemption saved: leave the loop, exit 0
            break
    ckpt.close()

Who does what under DDP: every rank holds the same state, so rank 0 alone reads and writes the store;
the loaded checkpoint is broadcast to the other ranks (S3 is read once per job, not once per rank), and
the preemption flag is all-reduced so every rank saves (rank 0) and exits at the same step. Under the
petctl agent, local rank 0 of every node also keeps the newest step in node memory (snapshot.py), and a
resume takes the newest snapshot any rank holds when the store has nothing newer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from petctl.core.eventlog import EventLog
from petctl.elastic import manifest as mf
from petctl.elastic.basecheckpointer import ENV_CHECKPOINT_URL, BaseCheckpointer
from petctl.elastic.cache import LocalCache
from petctl.elastic.snapshots.tier import SnapshotOptions, SnapshotTier
from petctl.elastic.startup import worker_started_at
from petctl.elastic.state import STATE_FILE, State, load_payload, save_snapshot
from petctl.elastic.store import CheckpointStore, S3Options

__all__ = ["ENV_CHECKPOINT_URL", "Checkpointer", "SnapshotOptions"]

IMPORTED_AT = time.time()  # `from petctl.elastic import Checkpointer` is done (the recovery timeline)


class Checkpointer(BaseCheckpointer):
    """Saves and restores a `State` under one checkpoint URL (`s3://...` or `file://...`).

    url: checkpoint prefix; default `$PETCTL_CHECKPOINT_URL` (set by the agent).
    keep: newest complete checkpoints to keep in the store (older ones are deleted after each save).
    every: save after every `every` completed steps (`(step + 1) % every == 0`); 0: never; "auto": every
        Young/Daly interval for the measured save cost (autointerval.py; event `checkpoint.interval`).
    every_seconds: also save when this long has passed since the last save (or the start); 0: never.
        Only rank 0 decides (it alone writes), so ranks need not agree on the time.
    check_every: steps between preemption checks (each is one tiny all-reduce); 0 disables them.
    background: False makes every periodic save synchronous (preemption saves always are).
    cache_dir: node-local cache root (default `$PETCTL_CACHE_DIR` or <tmp>/petctl-cache); use_cache=False
        to always read the store.
    weights_only: passed to torch.load; set False only if `extra` holds arbitrary Python objects.
    reuse_buffers: keep the last CPU snapshot between saves and copy the next one into it. Costs one
        state's worth of host memory; saves the training thread the page faults of a fresh copy (a
        copy measured here: about 11 ms per 100 MB instead of 68 ms). False frees the copy after each upload.
    store: an explicit `CheckpointStore` (tests, custom backends); overrides the URL's default store.
    snapshots: the in-memory snapshot tier (`SnapshotOptions`, or False to switch it off); by default on
        under the petctl agent, every step while that costs under 1 % of the step (docs/elastic.md).
    """

    REPORTS_UPLOAD = True
    def __init__(self, url: str | None = None, keep: int = 3, every: int | str = 0, *,
                 every_seconds: float = 0.0,
                 check_every: int = 1,
                 background: bool = True, cache_dir: Path | str | None = None, use_cache: bool = True,
                 weights_only: bool = True, reuse_buffers: bool = True, s3: S3Options | None = None,
                 store: CheckpointStore | None = None, control_dir: Path | str | None = None,
                 log: EventLog | None = None, snapshots: SnapshotOptions | bool | None = None) -> None:
        super().__init__(url, keep, every, every_seconds, check_every, background, store, s3, control_dir,
                         log)
        self.weights_only = weights_only
        self.reuse_buffers = reuse_buffers
        self._staged: dict[str, Any] | None = None  # the last snapshot: its tensors are reused
        self.cache = LocalCache(self.url, Path(cache_dir) if cache_dir else None) if use_cache else None
        if self.cache is not None and self.comm.is_writer:
            self.cache.sweep()
        self.last_saved: mf.Manifest | None = None  # newest manifest this process wrote
        self.snapshots = SnapshotTier(self.comm, self.log, snapshots)
        self._setup_auto("replicated" if self.snapshots.writer is not None else "none")

    # --- resume ----------------------------------------------------------------------------------
    def resume(self, state: State) -> int:
        """Load the newest complete checkpoint into `state`; returns the next step to run (0 if none).
        Collective under torch.distributed: rank 0 reads (cache or store) and broadcasts the bytes.
        Emits `checkpoint.resumed` on every rank (see `report_resumed`)."""
        started = time.time()
        step, source = self._resume(state)
        report_resumed(self.log, self.comm, step, source, started)
        self._auto_resumed(source)
        self.snapshots.prepare(state)  # the snapshot memory, mapped beside the first step
        return step

    def _resume(self, state: State) -> tuple[int, str]:
        """(next step, where it came from: snapshot, cache, store or none)."""
        taken = self.snapshots.resume(lambda: _store_step(self), self.weights_only)
        if taken is not None:
            return _adopt(self, state, *taken), "snapshot"
        t0 = time.monotonic()
        found: tuple[int, Path, dict[str, Any], str] | None = None
        failure: str | None = None
        if self.comm.is_writer or not self.comm.distributed:
            try:
                found = self._load_newest()
            except Exception as e:
                if not self.comm.distributed:
                    raise
                failure = f"{type(e).__name__}: {e}"  # tell the other ranks instead of leaving them hanging
        if not self.comm.distributed:
            return (0, "none") if found is None else (_adopt(self, state, found[0], found[2]), found[3])
        message: Any = ("error", failure) if failure is not None else (
            None if found is None else ("ok", found[0], found[1].read_bytes(), found[3]))
        shared = self.comm.broadcast_object(message)
        if shared is None:
            return 0, "none"
        if shared[0] == "error":
            raise RuntimeError(f"resume failed on rank 0: {shared[1]}")
        _kind, step, data, source = shared
        if self.comm.is_writer:
            assert found is not None
            snapshot = found[2]
        else:
            _step, snapshot = load_payload(data, self.weights_only)
            self.log.emit("checkpoint.loaded", step=step, source="broadcast", bytes=len(data),
                          seconds=round(time.monotonic() - t0, 3), url=self.url)
        return _adopt(self, state, step, snapshot), source

    def step_end(self, step: int, state: State) -> bool:
        """As `BaseCheckpointer.step_end`, after starting this step's in-memory snapshot (when due)."""
        self.snapshots.take(step, state)
        return super().step_end(step, state)

    def close(self) -> None:
        """Commit the snapshot in flight, then as `BaseCheckpointer.close`."""
        self.snapshots.close()
        super().close()

    def _load_newest(self) -> tuple[int, Path, dict[str, Any], str] | None:
        """Newest manifest whose objects verify and load; corrupt ones are reported and skipped."""
        t0 = time.monotonic()
        for manifest in mf.readable_manifests(self.store, self._report_corrupt):
            step = manifest.step
            found = self._fetch(manifest)
            if found is None:
                continue
            path, source = found
            try:
                loaded_step, snapshot = load_payload(path / _state_name(manifest), self.weights_only)
            except Exception as e:  # verified bytes that torch cannot read: same as corrupt...
                if self.weights_only and "weights_only" in str(e):  # ...unless it is our unpickler's choice
                    raise ValueError(
                        f"checkpoint {step} holds objects torch.load(weights_only=True) refuses (see the "
                        "error below); keep `extra` to tensors/numbers/strings/containers, or pass "
                        f"Checkpointer(weights_only=False) if you trust {self.url}: {e}") from e
                self.log.emit("checkpoint.skipped_corrupt", step=step, reason=f"load: {e!r}", url=self.url)
                continue
            self.log.emit("checkpoint.loaded", step=loaded_step, source=source, bytes=manifest.total_bytes,
                          seconds=round(time.monotonic() - t0, 3), url=self.url)
            return loaded_step, path / _state_name(manifest), snapshot, source
        return None

    def _fetch(self, manifest: mf.Manifest) -> tuple[Path, str] | None:
        """A local directory holding the manifest's verified objects: the cache, else a download."""
        return (self.cache or LocalCache(self.url)).fetch(self.store, manifest, self._report_corrupt)

    # --- saving ----------------------------------------------------------------------------------
    def save(self, step: int, state: State, block: bool = False) -> mf.Manifest | None:
        """Save `state` as checkpoint `step` (rank 0 only; other ranks return None at once).

        The state is copied to CPU here, on the calling thread; serialising and uploading happen in
        the background unless `block`. A save waits only for the previous upload still in flight.
        Returns the manifest when `block` and the save succeeded (None when it failed or was fenced).
        """
        if not self.comm.is_writer:
            return None
        if step == self._submitted_step:  # already saved (or uploading): never upload a step twice
            if not block:
                return None
            done = self._uploader.wait()
            if done is not None and done.step == step:
                return done  # else that attempt failed: save again below
        # The previous snapshot's buffers are free once its upload is done: copy into them rather than
        # fault in fresh memory on the training thread. Still uploading: a fresh copy, never wait here.
        reuse = self._staged if self.reuse_buffers and not self._uploader.busy else None
        snapshot = state.snapshot(reuse=reuse)
        self._staged = snapshot if self.reuse_buffers else None
        self._saved_now(step)
        self._uploader.submit(lambda: self._write(step, snapshot))
        return self._uploader.wait() if block else None

    def _write(self, step: int, snapshot: dict[str, Any]) -> mf.Manifest | None:
        """Background thread: serialise to the node-local staging dir, upload data, then manifest. None
        when fenced (fence.py): nothing made visible. Raises what serialising or the store raises."""
        t0 = time.monotonic()
        if self.fence.blocks(step, "upload"):
            return None
        cache = self.cache or LocalCache(self.url)
        staging = cache.staging(step)
        try:
            files, entries = save_snapshot(snapshot, step, staging)
            meta = {"world_size": self.comm.world_size, "torch": torch.__version__,
                    "node_id": os.environ.get("PETCTL_NODE_ID", "")}
            manifest = mf.write_checkpoint(self.store, step, files, meta, entries=entries,
                                           may_commit=lambda: not self.fence.blocks(step, "commit"))
        except BaseException:
            cache.discard(staging)
            raise
        if manifest is None:  # fenced between upload and commit: the data stays unnamed, never loaded
            cache.discard(staging)
            return None
        # The checkpoint is complete and visible now; what follows is housekeeping whose failure must
        # not turn a good save (say, the preemption save) into a reported failure.
        try:
            if self.cache is not None:
                self.cache.commit(staging, step)
            else:
                cache.discard(staging)
        except OSError as e:
            cache.discard(staging)
            self.log.emit("checkpoint.cache_failed", step=step, error=repr(e))
        deleted = self._prune(step)
        self.last_saved = manifest
        upload_s = time.monotonic() - t0
        self.log.emit("checkpoint.saved", step=step, bytes=manifest.total_bytes,
                      seconds=round(upload_s, 3), url=self.url, pruned=deleted)
        self._auto_upload(upload_s)
        return manifest

    def _save_for_preemption(self, step: int, state: State) -> bool:
        """Synchronous save of `step` on rank 0; its outcome is broadcast, which is also the barrier:
        no rank reports the save before rank 0 made it."""
        ok = True
        if self.comm.is_writer:
            try:
                ok = self.save(step, state, block=True) is not None
            except Exception as e:  # noqa: BLE001 - whatever failed, the other ranks wait in the broadcast below: they must hear it
                self.log.emit("checkpoint.save_failed", step=step, error=repr(e), url=self.url)
                ok = False
        return bool(self.comm.broadcast_object(ok))


def _store_step(ckpt: Checkpointer) -> int | None:
    """The store's newest checkpoint step, which a snapshot must match (None: none, or unreadable)."""
    try:
        return next((m.step for m in mf.readable_manifests(ckpt.store, ckpt._report_corrupt)), None)
    except (OSError, ValueError) as e:  # a snapshot can still be had while the store is away
        ckpt.log.emit("checkpoint.store_unreadable", error=repr(e), url=ckpt.url)
        return None


def _adopt(ckpt: Checkpointer, state: State, step: int, snapshot: dict[str, Any]) -> int:
    """Load the snapshot of checkpoint `step` into `state` (never saved again); the next step to run."""
    state.load_state_dict(snapshot)
    ckpt._submitted_step = step
    return step + 1


def report_resumed(log: EventLog, comm: Any, step: int, source: str, started: float) -> int:
    """Emit `checkpoint.resumed`: the next step, the tier it came from (snapshot, cache, store, none), and
    when this worker started, imported petctl.elastic, made its `Comm` and began resuming (a recovery's
    phases, bench/phases.py). Returns `step`."""
    log.emit("checkpoint.resumed", step=step, source=source, world_size=comm.world_size,
             seconds=round(time.time() - started, 4), worker_started=_ts(worker_started_at()),
             elastic_imported=_ts(IMPORTED_AT), comm_ready=_ts(comm.created_at), resume_started=_ts(started))
    return step


def _ts(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _state_name(manifest: mf.Manifest) -> str:
    """The object holding the serialised state (one today; the manifest allows more, e.g. DCP shards)."""
    return STATE_FILE if any(e.name == STATE_FILE for e in manifest.objects) else manifest.objects[0].name
