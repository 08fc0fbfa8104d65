"""What `Checkpointer` and `ShardedCheckpointer` share: the URL and store, when to save (every N steps,
every T seconds, at a preemption, at the agent's request), the preemption save's protocol and events, and
a clean end.

A subclass says how a state is saved and loaded (`save`, `resume`, `_save_for_preemption`); the skeleton
around them is written once here, so the two checkpointers cannot drift apart (the sharded one once
lacked `every_seconds` that way).

Who decides a time-based save: the one-writer `Checkpointer` saves on rank 0 only, so rank 0's clock
alone decides (`AGREE_ON_TIME = False`, no collective). A sharded save is collective, so every rank must
save at the same step: the ranks agree on "is a time-based save due" in the all-reduce the preemption
check already runs (one collective, two flags), hence on the check steps (every `check_every` steps).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from petctl.core.eventlog import EventLog
from petctl.elastic import manifest as mf
from petctl.elastic.autowire import AutoWire
from petctl.elastic.background import BackgroundUploader
from petctl.elastic.dist import Comm
from petctl.elastic.fence import CommitFence
from petctl.elastic.preemption import PreemptionMonitor
from petctl.io.objstore import ObjectStore, S3Options, open_store

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
                             "save in the preemption check's all-reduce")
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
        self.preemption = PreemptionMonitor(comm=self.comm, check_every=check_every,
                                            **({"control_dir": Path(control_dir)} if control_dir else {}))
        self.preemption.announce()
        self.fence = CommitFence(self.preemption.control_dir, self.log, self.url)  # see fence.py
        self._store = store
        self._s3 = s3
        self._uploader = BackgroundUploader(on_error=self._on_save_error)
        self._submitted_step: int | None = None  # the newest step handed to a save (never saved twice)
        self.preempted_at: int | None = None  # the step of the preemption save, once made

    # --- the store (opened on first use: ranks that never read or write need no credentials) -----
    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = open_store(self.url, self._s3)
        return self._store

    # --- what the subclass provides ----------------------------------------------------------------
    def save(self, step: int, state: Any, block: bool = False) -> Any:
        """Save `state` as checkpoint `step` (see the subclass)."""
        raise NotImplementedError

    def _save_for_preemption(self, step: int, state: Any) -> bool:
        """A synchronous save of `step`; True on every rank when it is complete everywhere (collective)."""
        raise NotImplementedError

    # --- when to save --------------------------------------------------------------------------------
    def should_checkpoint(self, step: int) -> bool:
        """True on every rank at the same step when any node of the job has a preemption pending."""
        return self.preemption.should_checkpoint(step)

    def step_end(self, step: int, state: Any) -> bool:
        """Call after each completed step (on every rank). True: the preemption save of `step` is
        done and this worker should leave its training loop and exit 0."""
        if self.preempted_at is not None:  # saved already: the loop should have ended, don't save again
            return True
        preempt, time_due, requested = self._poll(step)
        if preempt:
            self._preemption_save(step, state)
            self.preempted_at = step
            self._answered(step)  # the preemption save answers a request too
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

    # --- every="auto" (autointerval.py decides, autowire.py measures and reports) --------------------
    def _setup_auto(self, tier: str) -> None:
        """Called by the subclass once it knows its snapshot tier (none | replicated | sharded)."""
        if self._auto_requested:
            self.auto = AutoWire(self.comm.world_size, tier, self.log, self.preemption.control_dir,
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
        """(preemption pending, a time-based save due, a checkpoint requested), the same on every rank
        where that matters; the request always is (the ranks save it together, whoever writes)."""
        time_due = self.every_seconds > 0 and time.monotonic() - self._last_save_at >= self.every_seconds
        verdict = self.preemption.check(step, also=time_due and self.AGREE_ON_TIME)
        if self.AGREE_ON_TIME:
            return verdict
        return verdict.preempt, time_due and self.comm.is_writer, verdict.checkpoint

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
        seq, reason = self.preemption.asked, self.preemption.request()[1]
        try:
            answered = self.preemption.report_checkpointed(step)
        except OSError as e:
            self.log.emit("checkpoint.request_unrecorded", step=step, seq=seq, error=repr(e))
            answered = None
        mine = answered is not None and self.comm.local_rank == 0
        if mine or (requested and self.comm.is_writer):
            self.log.emit("checkpoint.request_answered", step=step, preempted=not requested,
                          **({"seq": seq, "reason": reason} if mine else {}))

    def _saved_now(self, step: int) -> None:
        """A save of `step` was handed over: it is not saved again, and the clock restarts."""
        self._submitted_step = step
        self._last_save_at = time.monotonic()

    # --- the preemption protocol -------------------------------------------------------------------
    def _preemption_save(self, step: int, state: Any) -> None:
        """Save `step` synchronously, then (when it is complete everywhere) tell the agent, which lets
        this worker exit; the events say which it was."""
        self.log.emit("preempt.detected", step=step, deadline=self.preemption.deadline())
        ok = self._save_for_preemption(step, state)
        if ok:
            self.preemption.report_saved(step)
        self.log.emit("preempt.saved" if ok else "preempt.save_failed", step=step)

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
