"""Writes a node's in-memory snapshot at step boundaries, off the training thread where that is safe.

At `take(step, state)` the training thread lays the state out (`snapcodec`), serialises the skeleton
(the only deep copy it makes), blanks the file's header and copies what the next forward pass could
change (module buffers, schedulers, extras) itself. Parameters and optimizer state change only inside
`optimizer.step()`, so a background thread copies those while the next step's forward and backward run,
and a pre-hook on the optimizer holds the next `step()` until the copy is done: the snapshot is the state
after `step`, exactly, at the cost of a wait only when a step is shorter than the copy. The same thread
then checksums the payload and writes the header last (the commit; see `petctl.core.snapshotrecord`).
A GPU state is copied on a stream of its own into the mapping, page-locked (`snapdevice`).

The file is preallocated (`posix_fallocate`) so a full tmpfs is an error at allocation time, never a
SIGBUS in the middle of a copy; any failure disables snapshots for this worker (`snapshot.disabled`, once)
and training goes on with the store alone. How often: `snapcadence`.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from petctl.core.eventlog import EventLog
from petctl.core.snapshotrecord import BLANK, HEADER_SIZE, SnapshotHeader
from petctl.elastic.background import yield_cpu_to_training
from petctl.elastic.snapcadence import Cadence
from petctl.elastic.snapcodec import Layout, encode_meta, flatten, payload_checksum, tensor_view
from petctl.elastic.snapdevice import DeviceCopy

INLINE_BYTES = 1 << 20  # a state this small is committed on the training thread: cheaper than a handoff
META_ROOM = 64 * 1024  # the skeleton's bytes vary from step to step: room to grow without a remap
ZERO = {"copy_s": 0.0, "crc_s": 0.0, "blocked_s": 0.0, "cpu_s": 0.0, "hook_wait_s": 0.0, "bg_cpu_s": 0.0,
        "bytes": 0, "busy_s": 0.0}
# What a snapshot can fail with: the file (OSError: ENOSPC), the mapping (IndexError, BufferError, ValueError)
# or a copy (RuntimeError). Anything else is a bug and is raised.
FAILURES = (OSError, ValueError, RuntimeError, IndexError, BufferError)


class SnapshotFile:
    """The mapped file: grown and preallocated on demand, its header blanked and committed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.mm: mmap.mmap | None = None
        self._views: tuple[Layout, list[torch.Tensor]] | None = None  # tensors viewing the mapping
        self.before_unmap: Any = None  # called while the mapping is still there (to unpin it)

    def views(self, layout: Layout) -> list[torch.Tensor]:
        """One tensor per slot of `layout`, viewing its place in the mapping (made once per layout)."""
        assert self.mm is not None
        if self._views is None or self._views[0] is not layout:
            self._views = (layout, [tensor_view(self.mm, slot, HEADER_SIZE) for slot in layout.slots])
        return self._views[1]

    def room(self, payload: int) -> mmap.mmap:
        """The mapping, grown (preallocated, pre-faulted) when `payload` bytes do not fit. Raises OSError
        (ENOSPC: the tmpfs is full). Only while no view into the old mapping is alive."""
        size = HEADER_SIZE + payload
        if self.mm is not None and size <= len(self.mm):
            return self.mm
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        size = -(-(size + META_ROOM) // mmap.PAGESIZE) * mmap.PAGESIZE
        self.unmap()
        os.posix_fallocate(self.fd, 0, size)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        return self.mm

    def commit(self, header: SnapshotHeader) -> None:
        """Checksum the payload `header` describes and write the header: the snapshot is valid from here."""
        assert self.mm is not None
        crc = payload_checksum(self.mm, HEADER_SIZE, header.payload_length)
        self.mm[:HEADER_SIZE] = dataclasses.replace(header, checksum=crc).pack()

    def unmap(self) -> None:
        self._views = None  # they hold the mapping's buffer: released before it closes
        if self.mm is not None and self.before_unmap is not None:
            self.before_unmap()
        if self.mm is not None:
            self.mm.close()
            self.mm = None

    def close(self) -> None:
        self.unmap()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SnapshotWriter:
    """One snapshot file, rewritten in place (the header committed last), for one training thread."""

    def __init__(self, path: Path, job: str, round_no: int, rank: int, world_size: int, log: EventLog, *,
                 every: int | None = None, overlap: bool = True, budget: float = 0.01) -> None:
        self.path, self.job, self.round, self.rank, self.world_size = path, job, round_no, rank, world_size
        self.log = log
        self.cadence = Cadence(fixed=every, budget=budget)
        self.overlap = overlap
        self.disabled: str | None = None
        self.taken = 0
        self.stats = dict(ZERO)  # of the snapshots after the first (which maps and faults in the memory)
        self.first_ms: float | None = None  # the first snapshot's cost to the training thread
        self.file = SnapshotFile(path)
        self.device = DeviceCopy(log=log)
        self.file.before_unmap = self.device.unpin
        self._layout: Layout | None = None
        # Niced like the uploader: when cores are short the step goes first, and a copy that then ends
        # late holds the next optimizer.step(), a wait the cadence sees (and answers with a larger K).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="petctl-snap",
                                        initializer=yield_cpu_to_training)
        self._pending: Future[None] | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._hooked: Any = None  # the optimizer whose step waits for the copy
        self._hook: Any = None
        self._last_cost = 0.0  # the newest snapshot's cost so far (its hook wait comes later)
        self._busy: float | None = None  # the newest committed snapshot's background seconds
        self._measured = False  # the newest snapshot's cost counts (not a first touch of the memory)

    # --- the training thread ---------------------------------------------------------------------
    def prepare(self, state: Any) -> None:
        """Map (allocate, fault in) the file for `state` in the background, so the first snapshot after a
        (re)start does not pay for it on the training thread (about 5 ms per 100 MB here, seconds for a
        large state on a fresh node). A failure surfaces at the first `take` (and disables snapshots)."""
        if self.disabled is not None or self._pending is not None:
            return
        tensors: list[torch.Tensor] = []
        flatten(state.state_dict(), tensors, [])
        layout = Layout.of(tensors)
        self._pending = self._pool.submit(lambda: self.device.prepare(self.file.room(layout.data_length),
                                                                      tensors))

    def take(self, step: int, state: Any) -> bool:
        """Snapshot the state after `step` when one is due; True when one was started. Never raises:
        a failure disables snapshots (reported once)."""
        if not self.cadence.step_ended(time.monotonic()) or self.disabled is not None:
            return False
        if self.cadence.fixed is None and self._pending is not None and not self._pending.done():
            return False  # the previous one is still being written: the next step end, not a wait
        try:
            self._start(step, state)
        except FAILURES as e:
            self._disable(f"{type(e).__name__}: {e}", step)
            return False
        return True

    def _start(self, step: int, state: Any) -> None:
        t0 = time.monotonic()
        counted = self._finish()  # the previous snapshot is committed: its cost is complete
        if self.taken == 1:
            self.first_ms = round(1e3 * (self.stats["blocked_s"] + self.stats["hook_wait_s"]), 3)
            self.stats = dict(ZERO)
            self.device.seconds, self.device.bytes = 0.0, 0
        busy, self._busy = self._busy, None
        stall = self.device.stall()  # the previous GPU copy's hold on the training stream, if timed yet
        if stall is not None:
            self.stats["hook_wait_s"] += stall
            self._last_cost += stall
        if counted or busy is not None:
            changed = self.cadence.record(self._last_cost if counted else None, busy, timed=stall is not None)
            if changed is not None:
                self.log.emit("snapshot.every", step=step, every=changed[0], was=changed[1],
                              cost_ms=round(1e3 * changed[2], 3), step_ms=round(1e3 * changed[3], 3))
        waited, cpu0 = time.monotonic() - t0, time.thread_time()
        tensors: list[torch.Tensor] = []
        roots: list[str] = []
        skeleton = flatten(state.state_dict(), tensors, roots)
        relaid = self._layout is None or not self._layout.fits(tensors)
        layout = Layout.of(tensors) if relaid or self._layout is None else self._layout
        meta = encode_meta(skeleton, layout)
        mm = self.file.room(layout.data_length + len(meta))
        self._layout = layout
        mm[:HEADER_SIZE] = BLANK  # from here on a reader sees no snapshot until the commit
        later = self._background(state, tensors, roots)
        self.device.mark([tensors[i] for i in later])
        views = self.file.views(layout)
        t_copy = time.monotonic()
        for i, tensor in enumerate(tensors):
            if i not in later:
                views[i].copy_(tensor)
        self.stats["copy_s"] += time.monotonic() - t_copy
        rest = [(i, tensors[i]) for i in later]
        launched = bool(rest) and self.device.launch(mm, views, rest)  # a GPU state: held on the GPU
        if later and not launched:
            self._copied.clear()
        header = SnapshotHeader(job=self.job, round=self.round, step=step, rank=self.rank,
                                world_size=self.world_size, data_length=layout.data_length,
                                meta_offset=layout.data_length, meta_length=len(meta), checksum=0)
        if layout.data_length <= INLINE_BYTES and not launched:
            self._commit(header, layout, rest, meta)
        else:
            self._pending = self._pool.submit(self._commit, header, layout, rest, meta, launched)
        cpu = time.thread_time() - cpu0
        self.stats["blocked_s"] += time.monotonic() - t0
        self.stats["cpu_s"] += cpu
        self._last_cost, self._measured = waited + cpu, not relaid
        self.cadence.started()
        self.taken += 1
        if self.taken == 1:
            self.log.emit("snapshot.enabled", step=step, path=str(self.path), bytes=layout.data_length,
                          tensors=len(tensors), background=len(later), every=self.cadence.fixed or "auto")

    def _background(self, state: Any, tensors: list[torch.Tensor], roots: list[str]) -> set[int]:
        """Indices of the tensors only `optimizer.step()` changes (copied in the background, the next
        step held until they are): the optimizer's state and the model's parameters."""
        optimizer = state.optimizer
        if not self.overlap or optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
            return set()
        if self._hooked is not optimizer:
            if self._hook is not None:
                self._hook.remove()
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
            self._hooked = optimizer
        params = {p.data_ptr() for group in optimizer.param_groups for p in group["params"]}
        return {i for i, (t, root) in enumerate(zip(tensors, roots, strict=True))
                if root == "optimizer" or (root == "model" and t.data_ptr() in params and t.numel() > 0)}

    def _before_optimizer_step(self, *_: Any) -> None:
        self.device.gate()  # a launched GPU copy: the training stream waits for it, the CPU does not
        if not self._copied.is_set():
            t0 = time.monotonic()
            self._copied.wait()
            waited = time.monotonic() - t0
            self.stats["hook_wait_s"] += waited
            self._last_cost += waited

    # --- the background thread -------------------------------------------------------------------
    def _commit(self, header: SnapshotHeader, layout: Layout, later: list[tuple[int, torch.Tensor]],
                meta: bytes, launched: bool = False) -> None:
        """Copy what was left (or wait for the GPU copy `launched` on the training thread), write the meta,
        checksum, and commit the header."""
        mm = self.file.mm
        assert mm is not None
        t0, cpu0 = time.monotonic(), time.thread_time()
        views = self.file.views(layout)
        try:
            if launched:
                self.device.wait(self._copied.set)
            else:
                self.device.copy(mm, views, later, self._copied.set)
        finally:
            self._copied.set()
        t1 = time.monotonic()
        start = HEADER_SIZE + header.meta_offset
        mm[start:start + len(meta)] = meta
        self.file.commit(dataclasses.replace(header, written_at=time.time()))
        self.stats["copy_s"] += t1 - t0
        self.stats["crc_s"] += time.monotonic() - t1
        self.stats["bg_cpu_s"] += time.thread_time() - cpu0  # the copy and the checksum: CPU, not wall
        self.stats["bytes"] += layout.data_length
        self._busy = time.monotonic() - t0
        self.stats["busy_s"] += self._busy

    def _finish(self) -> bool:
        """Wait for the snapshot in flight; True when its cost counts. Raises what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        counted, self._measured = self._measured, False
        return counted

    # --- the end ---------------------------------------------------------------------------------------
    def _disable(self, reason: str, step: int) -> None:
        self.disabled = reason
        self._copied.set()
        self.log.emit("snapshot.disabled", step=step, reason=reason, path=str(self.path))

    def report(self) -> dict[str, Any]:
        """`snapshot.stats`: how many, what the first cost the training thread, and what the others cost
        (per snapshot, milliseconds; the copy's rate from the others alone)."""
        n, s = max(1, self.taken - 1), self.stats
        mb = s["bytes"] / 1e6
        step = self.cadence.step_time()
        return {"snapshots": self.taken, "every": self.cadence.every, "first_ms": self.first_ms,
                "bytes": self._layout.data_length if self._layout else 0,
                "blocked_ms": round(1e3 * s["blocked_s"] / n, 3), "cpu_ms": round(1e3 * s["cpu_s"] / n, 3),
                "hook_wait_ms": round(1e3 * s["hook_wait_s"] / n, 3),
                "copy_ms": round(1e3 * s["copy_s"] / n, 3), "crc_ms": round(1e3 * s["crc_s"] / n, 3),
                "background_cpu_ms": round(1e3 * s["bg_cpu_s"] / n, 3),
                "copy_ms_per_100mb": round(1e5 * s["copy_s"] / mb, 3) if mb else None,
                "busy_ms": round(1e3 * s["busy_s"] / n, 3), **self.device.report(n),
                "step_ms": round(1e3 * step, 3) if step else None, "disabled": self.disabled}

    def close(self) -> None:
        """Commit the snapshot in flight, release the optimizer hook, the mapping and the thread. The
        file stays: it belongs to the agent's directory."""
        try:
            self._finish()
        except FAILURES as e:
            self._disable(f"{type(e).__name__}: {e}", -1)
        if self._hook is not None:
            self._hook.remove()
            self._hook = self._hooked = None
        self._pool.shutdown(wait=True)
        self.file.close()
        if self.taken:
            self.log.emit("snapshot.stats", **self.report())
