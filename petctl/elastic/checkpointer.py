"""The durable checkpointers: the base both share (`BaseCheckpointer`) and the replicated `Checkpointer`.

`Checkpointer`: resume in one call, periodic saves in the background, a clean exit on a save-now request.

    state = State(model=model, optimizer=opt, scheduler=sched, extra={"step": 0})
    ckpt = Checkpointer(keep=3, every=50)            # URL from $PETCTL_CHECKPOINT_URL
    start = ckpt.resume(state)                       # next step to run (0 on a fresh start)
    for step in range(start, total):
        train_step()
        if ckpt.step_end(step, state):               # saved for a save-now: leave the loop, exit 0
            break
    ckpt.close()

Who does what under DDP: every rank holds the same state, so rank 0 alone reads and writes the store;
the loaded checkpoint is broadcast to the other ranks (S3 is read once per job, not once per rank), and
the save-now flag (a notice, a leave, an admission) is all-reduced so every rank saves (rank 0) and exits at
the same step. Under the petctl agent, local rank 0 of every node also keeps the newest step in node memory
(snapshots/), and a resume takes the newest snapshot any rank holds when the store has nothing newer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from petctl.elastic import manifest as mf
from petctl.elastic.autointerval import AutoWire
from petctl.elastic.background import BackgroundUploader
from petctl.elastic.dist import Comm
from petctl.elastic.manifest import LocalCache
from petctl.elastic.snapshots import SnapshotOptions, SnapshotTier
from petctl.elastic.state import STATE_FILE, State, load_payload, save_staged
from petctl.elastic.workerprotocol import CommitFence, SaveNowMonitor, worker_started_at
from petctl.io.eventlog import EventLog
from petctl.io.objstore import ObjectStore, S3Options, open_object_store
from petctl.io.objstore import ObjectStore as CheckpointStore

# --- the base both checkpointers share ----------------------------------------------------------------------
# What `Checkpointer` and `ShardedCheckpointer` share: the URL and store, when to save (every N steps,
# every T seconds, at a save-now request, at the agent's checkpoint request), the save-now protocol and its
# events, and a clean end.
#
# A subclass says how a state is saved and loaded (`save`, `resume`, `_save_for_save_now`); the skeleton
# around them is written once here, so the two checkpointers cannot drift apart (the sharded one once
# lacked `every_seconds` that way).
#
# Who decides a time-based save: the one-writer `Checkpointer` saves on rank 0 only, so rank 0's clock
# alone decides (`AGREE_ON_TIME = False`, no collective). A sharded save is collective, so every rank must
# save at the same step: the ranks agree on "is a time-based save due" in the all-reduce the save-now
# check already runs (one collective, two flags), hence on the check steps (every `check_every` steps).


ENV_CHECKPOINT_URL = "PETCTL_CHECKPOINT_URL"

_Self = TypeVar("_Self", bound="BaseCheckpointer")


class BaseCheckpointer:
    """The shared skeleton (see the module docstring). Arguments as documented on `Checkpointer`."""

    AGREE_ON_TIME: ClassVar[bool] = False  # True: time-based saves are collective decisions
    REPORTS_UPLOAD: ClassVar[bool] = False  # True: the subclass reports each upload's time (`_auto_upload`)

    def __init__(self, url: str | None, keep: int, every: int | str, every_seconds: float, check_every: int,
                 background: bool, store: ObjectStore | None, s3: S3Options | None,
                 control_dir: Path | str | None, log: EventLog | None) -> None:
        url = url or (store.url if store is not None else os.environ.get(ENV_CHECKPOINT_URL, ""))
        if not url:
            raise ValueError(f"no checkpoint URL: pass url= or set ${ENV_CHECKPOINT_URL}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        auto = every == "auto"
        if not auto and (not isinstance(every, int) or every < 0):
            raise ValueError(f"every must be a number of steps >= 0 or 'auto' (got {every!r})")
        if (every_seconds > 0 or auto) and self.AGREE_ON_TIME and check_every <= 0:
            raise ValueError("every_seconds needs check_every >= 1 here: the ranks agree on a time-based "
                             "save in the save-now check's all-reduce")
        self.url = url
        self.keep = keep
        self.every = 0 if auto else int(every)
        self.every_seconds = every_seconds
        self.auto: AutoWire | None = None  # every="auto": made by `_setup_auto` once the tier is known
        self._auto_requested = auto
        self._stall_s = 0.0  # the training thread's time in the newest periodic save
        self.background = background
        self._last_save_at = time.monotonic()
        self.comm = Comm.create()  # collective when dist uses NCCL: every rank constructs it
        self.log = log or EventLog("elastic", rank=self.comm.rank, node_id=os.environ.get("PETCTL_NODE_ID"))
        self.monitor = SaveNowMonitor(comm=self.comm, check_every=check_every,
                                      **({"control_dir": Path(control_dir)} if control_dir else {}))
        self.monitor.announce()
        self.fence = CommitFence(self.monitor.control_dir, self.log, self.url)  # see workerprotocol.py
        self._store = store
        self._s3 = s3
        self._uploader = BackgroundUploader(on_error=self._on_save_error)
        self._submitted_step: int | None = None  # the newest step handed to a save (never saved twice)
        self.stopped_at: int | None = None  # the step saved for a save-now request, once made

    # --- the store (opened on first use: ranks that never read or write need no credentials) -----
    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = open_object_store(self.url, self._s3)
        return self._store

    # --- what the subclass provides ----------------------------------------------------------------
    def save(self, step: int, state: Any, block: bool = False) -> Any:
        """Save `state` as checkpoint `step` (see the subclass)."""
        raise NotImplementedError

    def _save_for_save_now(self, step: int, state: Any) -> bool:
        """A synchronous save of `step`; True on every rank when it is complete everywhere (collective)."""
        raise NotImplementedError

    def _step_snapshot(self, step: int, state: Any) -> None:
        """Start this step's in-memory snapshot, when due (the subclass's tier; none here)."""

    # --- when to save --------------------------------------------------------------------------------
    def should_checkpoint(self, step: int) -> bool:
        """True on every rank at the same step when the job's running round carries a save-now request."""
        return self.monitor.should_checkpoint(step)

    def step_end(self, step: int, state: Any) -> bool:
        """Call after each completed step (on every rank). True: the save-now save of `step` is
        done and this worker should leave its training loop and exit 0.

        It first tells the state's step-counting parts (an `ElasticSampler`'s `step_done`) that `step` is
        done, so whatever it saves holds the data position after `step`."""
        if self.stopped_at is not None:  # saved already: the loop should have ended, don't save again
            return True
        count_step(state, step)
        self._step_snapshot(step, state)
        save_now, time_due, requested = self._poll(step)
        if save_now:
            self._answer_save_now(step, state)
            self.stopped_at = step
            self._answered(step)  # the save-now save answers a checkpoint request too
            return True
        if requested:
            self._requested_save(step, state)
        elif time_due or (self.every > 0 and (step + 1) % self.every == 0):
            t0 = time.monotonic()
            self.save(step, state, block=not self.background)
            self._stall_s = time.monotonic() - t0
            if self.auto is not None and not self.REPORTS_UPLOAD and self._decides():
                self._auto_upload(0.0)
        return False

    # --- every="auto" (autointerval.py decides, autointerval.py measures and reports) --------------------
    def _setup_auto(self, tier: str) -> None:
        """Called by the subclass once it knows its snapshot tier (none | replicated | sharded)."""
        if self._auto_requested:
            self.auto = AutoWire(self.comm.world_size, tier, self.log, self.monitor.control_dir,
                                 report=self.comm.is_writer)
            self.every_seconds = self.auto.seconds

    def _decides(self) -> bool:
        """Who keeps the interval: the writer, or every rank where time-based saves are agreed on."""
        return self.comm.is_writer or self.AGREE_ON_TIME

    def _auto_resumed(self, source: str) -> None:
        if self.auto is not None and self._decides():
            self.auto.resumed(source, self.comm.world_size)
            self.every_seconds = self.auto.seconds

    def _auto_upload(self, upload_s: float) -> None:
        """A save is complete: its cost is the stall measured on the training thread plus `upload_s`."""
        if self.auto is not None:
            self.auto.saved(self._stall_s, upload_s, self.comm.world_size)
            self.every_seconds = self.auto.seconds

    def _poll(self, step: int) -> tuple[bool, bool, bool]:
        """(save-now pending, a time-based save due, a checkpoint requested), the same on every rank
        where that matters; the request always is (the ranks save it together, whoever writes)."""
        time_due = self.every_seconds > 0 and time.monotonic() - self._last_save_at >= self.every_seconds
        verdict = self.monitor.check(step, also=time_due and self.AGREE_ON_TIME)
        if self.AGREE_ON_TIME:
            return verdict
        return verdict.save_now, time_due and self.comm.is_writer, verdict.checkpoint

    # --- a checkpoint asked for by the agent (a rebalance recommendation) ------------------------------
    def _requested_save(self, step: int, state: Any) -> None:
        """Every rank agreed a node asked for a checkpoint now: save `step` (in the background when the
        checkpointer does), unless it is saved already, and train on."""
        if step != self._submitted_step:
            self.save(step, state, block=not self.background)
        self._answered(step, requested=True)

    def _answered(self, step: int, requested: bool = False) -> None:
        """Record the request this node had pending (if any) as answered by `step`. Said once by rank 0
        (`checkpoint.request_answered`, the step saved) and once by each node that asked (its seq and
        reason). An unwritable control dir is reported: the request would be answered again next round."""
        seq, reason = self.monitor.asked, self.monitor.request()[1]
        try:
            answered = self.monitor.report_checkpointed(step)
        except OSError as e:
            self.log.emit("checkpoint.request_unrecorded", step=step, seq=seq, error=repr(e))
            answered = None
        mine = answered is not None and self.comm.local_rank == 0
        if mine or (requested and self.comm.is_writer):
            self.log.emit("checkpoint.request_answered", step=step, save_now=not requested,
                          **({"seq": seq, "reason": reason} if mine else {}))

    def _saved_now(self, step: int) -> None:
        """A save of `step` was handed over: it is not saved again, and the clock restarts."""
        self._submitted_step = step
        self._last_save_at = time.monotonic()

    # --- the save-now protocol ---------------------------------------------------------------------
    def _answer_save_now(self, step: int, state: Any) -> None:
        """Save `step` synchronously, then (when it is complete everywhere) tell the agent, which lets
        this worker exit; the events say which it was."""
        self.log.emit("save_now.detected", step=step, deadline=self.monitor.deadline())
        ok = self._save_for_save_now(step, state)
        if ok:
            self.monitor.report_saved(step)
        self.log.emit("save_now.saved" if ok else "save_now.save_failed", step=step)

    # --- events ----------------------------------------------------------------------------------
    def _on_save_error(self, error: BaseException) -> None:
        self.log.emit("checkpoint.save_failed", error=repr(error), url=self.url)

    def _report_corrupt(self, step: int, reason: str) -> None:
        self.log.emit("checkpoint.skipped_corrupt", step=step, reason=reason, url=self.url)

    def _prune(self, step: int) -> list[int]:
        """Retention after the save of `step`. The checkpoint is complete by then, so a failure here is
        reported (`checkpoint.prune_failed`) and never turns a good save into a failed one."""
        try:
            return mf.prune(self.store, self.keep)
        except OSError as e:  # the store refused (AccessDenied on delete, say): retried after the next save
            self.log.emit("checkpoint.prune_failed", step=step, error=repr(e), url=self.url)
            return []

    # --- the end -------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the upload in flight (if any) is complete."""
        self._uploader.wait()

    def close(self) -> None:
        """Finish the upload in flight (a checkpoint half uploaded is worth nothing), then release the
        background thread and the gloo group (the one `Comm` created for checkpoint traffic, if any)."""
        self._uploader.close()
        self.comm.close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- Checkpointer -------------------------------------------------------------------------------------------


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
    check_every: steps between save-now checks (each is one tiny all-reduce); 0 disables them.
    background: False makes every periodic save synchronous (save-now saves always are).
    cache_dir: node-local cache root (default `$PETCTL_CACHE_DIR` or <tmp>/petctl-cache); use_cache=False
        to always read the store.
    weights_only: passed to torch.load; set False only if `extra` holds arbitrary Python objects.
    reuse_buffers: keep the last staged CPU copy between saves and copy the next one into it. Costs one
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
        self._staged: dict[str, Any] | None = None  # the last staged copy: its tensors are reused
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
            payload = found[2]
        else:
            _step, payload = load_payload(data, self.weights_only)
            self.log.emit("checkpoint.loaded", step=step, source="broadcast", bytes=len(data),
                          seconds=round(time.monotonic() - t0, 3), url=self.url)
        return _adopt(self, state, step, payload), source

    def _step_snapshot(self, step: int, state: State) -> None:
        self.snapshots.take(step, state)

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
                loaded_step, payload = load_payload(path / _state_name(manifest), self.weights_only)
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
            return loaded_step, path / _state_name(manifest), payload, source
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
        # The previous staged copy's buffers are free once its upload is done: copy into them rather than
        # fault in fresh memory on the training thread. Still uploading: a fresh copy, never wait here.
        reuse = self._staged if self.reuse_buffers and not self._uploader.busy else None
        staged = state.staged_copy(reuse=reuse)
        self._staged = staged if self.reuse_buffers else None
        self._saved_now(step)
        self._uploader.submit(lambda: self._write(step, staged))
        return self._uploader.wait() if block else None

    def _write(self, step: int, staged: dict[str, Any]) -> mf.Manifest | None:
        """Background thread: serialise to the node-local staging dir, upload data, then manifest. None
        when fenced (workerprotocol.py): nothing made visible. Raises what serialising or the store raises."""
        t0 = time.monotonic()
        if self.fence.blocks(step, "upload"):
            return None
        cache = self.cache or LocalCache(self.url)
        staging = cache.staging(step)
        try:
            files, entries = save_staged(staged, step, staging)
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
        # not turn a good save (say, the save-now save) into a reported failure.
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

    def _save_for_save_now(self, step: int, state: State) -> bool:
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


def count_step(state: Any, step: int) -> None:
    """Tell each stateful part of `state` that has `step_done` (an ElasticSampler) that `step` is done.

    `state` is a `State`, or a sharded checkpointer's dict of DCP Statefuls (a `ShardedState` among them).
    """
    holders = list(state.values()) if isinstance(state, dict) else [state]
    for holder in holders:
        for part in getattr(holder, "stateful", {}).values():
            step_done = getattr(part, "step_done", None)
            if callable(step_done):
                step_done(step)


def _store_step(ckpt: Checkpointer) -> int | None:
    """The store's newest checkpoint step, which a snapshot must match (None: none, or unreadable)."""
    try:
        return next((m.step for m in mf.readable_manifests(ckpt.store, ckpt._report_corrupt)), None)
    except (OSError, ValueError) as e:  # a snapshot can still be had while the store is away
        ckpt.log.emit("checkpoint.store_unreadable", error=repr(e), url=ckpt.url)
        return None


def _adopt(ckpt: Checkpointer, state: State, step: int, payload: dict[str, Any]) -> int:
    """Load the payload of checkpoint `step` (a loaded state dict, from memory or the store) into `state`
    (never saved again); the next step to run."""
    state.load_state_dict(payload)
    ckpt._submitted_step = step
    return step + 1


def report_resumed(log: EventLog, comm: Any, step: int, source: str, started: float) -> int:
    """Emit `checkpoint.resumed`: the next step, the tier it came from (snapshot, cache, store, framework,
    none), and when this worker started, imported petctl.elastic, made its `Comm` and began resuming (a
    recovery's phases, bench/phases.py). Returns `step`."""
    log.emit("checkpoint.resumed", step=step, source=source, world_size=comm.world_size,
             seconds=round(time.time() - started, 4), worker_started=_ts(worker_started_at()),
             elastic_imported=_ts(IMPORTED_AT), comm_ready=_ts(comm.created_at), resume_started=_ts(started))
    return step


def _ts(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _state_name(manifest: mf.Manifest) -> str:
    """The object holding the serialised state (one today; the manifest allows more, e.g. DCP shards)."""
    return STATE_FILE if any(e.name == STATE_FILE for e in manifest.objects) else manifest.objects[0].name
