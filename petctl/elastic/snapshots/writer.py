"""The replicated tier's writer: the snapshot file written at step boundaries, the cadence that keeps it
inside its budget, and the device copy that moves a GPU state into the mapped file.

Writes a node's in-memory snapshot at step boundaries, off the training thread where that is safe.

At `take(step, state)` the training thread lays the state out (`codec`), serialises the skeleton
(the only deep copy it makes), blanks the file's header and copies what the next forward pass could
change (module buffers, schedulers, extras) itself. Parameters and optimizer state change only inside
`optimizer.step()`, so a background thread copies those while the next step's forward and backward run,
and a pre-hook on the optimizer holds the next `step()` until the copy is done: the snapshot is the state
after `step`, exactly, at the cost of a wait only when a step is shorter than the copy. The same thread
then checksums the payload and writes the header last (the commit; see `petctl.core.snapshotrecord`).
A GPU state is copied on a stream of its own into the mapping, page-locked (`writer`).

The file is preallocated (`posix_fallocate`) so a full tmpfs is an error at allocation time, never a
SIGBUS in the middle of a copy; any failure disables snapshots for this worker (`snapshot.disabled`, once)
and training goes on with the store alone. How often: `writer`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import mmap
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from petctl.core.snapshotrecord import BLANK, HEADER_SIZE, SnapshotHeader
from petctl.elastic.background import yield_cpu_to_training
from petctl.elastic.snapshots.codec import Layout, encode_meta, flatten, payload_checksum, tensor_view
from petctl.io.eventlog import EventLog

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
        large state on a fresh node). A failure surfaces at the first `take` (and disables snapshots).

        A small CPU state (up to INLINE_BYTES, committed inline too) is mapped here, at once: it costs
        microseconds, while the background thread is niced and on a starved host may not run for several
        steps, and `take` skips a due snapshot while this is pending, so the round's first steps would go
        without one and a loss then would cost more than K steps."""
        if self.disabled is not None or self._pending is not None:
            return
        tensors: list[torch.Tensor] = []
        flatten(state.state_dict(), tensors, [])
        layout = Layout.of(tensors)
        if layout.data_length <= INLINE_BYTES and _cuda_device(tensors) is None:
            with contextlib.suppress(*FAILURES):  # not lost: the first `take` maps again, fails, reports
                self.file.room(layout.data_length)
            return
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
        # A first snapshot's CPU cost is not a measure (it touched the memory first), but its GPU hold,
        # timed by CUDA events, is: it counts alone, so a 16 GB copy raises K after one stall, not two.
        cost = self._last_cost if counted else stall
        changed = None
        if cost is not None or busy is not None:
            changed = self.cadence.record(cost, busy, timed=stall is not None)
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
        if changed is not None:
            self._announce(step, changed)
        cpu = time.thread_time() - cpu0
        self.stats["blocked_s"] += time.monotonic() - t0
        self.stats["cpu_s"] += cpu
        self._last_cost, self._measured = waited + cpu, not relaid
        self.cadence.started()
        self.taken += 1
        if self.taken == 1:
            self.log.emit("snapshot.enabled", step=step, path=str(self.path), bytes=layout.data_length,
                          tensors=len(tensors), background=len(later), every=self.cadence.fixed or "auto")

    def _announce(self, step: int, changed: tuple[int, int, float, float]) -> None:
        """`snapshot.every` once this snapshot, the one the new K follows, is committed: from then on a
        loss costs at most the new K steps (said earlier, a lowering would promise too much while the
        snapshot is still being written). Nothing when its commit fails: that disables the tier."""
        def say() -> None:
            self.log.emit("snapshot.every", step=step, every=changed[0], was=changed[1],
                          cost_ms=round(1e3 * changed[2], 3), step_ms=round(1e3 * changed[3], 3))

        pending = self._pending
        if pending is None:  # committed already, inline
            say()
        else:
            pending.add_done_callback(lambda done: say() if done.exception() is None else None)

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


# --- the device copy ----------------------------------------------------------------------------------------
# How a snapshot's background tensors reach the mapped file: a GPU state on a stream of its own, into
# the mapping pinned in place.
#
# A CPU tensor is copied into its place in the mapping as before. For CUDA tensors:
# - **its own stream**: on the training thread's stream the copy would queue behind the next step's
#   kernels and hold them up; on a stream of its own it runs on the copy engine beside them. The stream
#   first waits for an event the training thread recorded at the snapshot (`mark`), after the step's
#   `optimizer.step()`, so the copy reads the state after that step and nothing later.
# - **pinned memory, in place**: a device-to-host copy into pageable memory goes through the driver's
#   bounce buffer and blocks the calling thread; into page-locked memory it is one DMA at the link's
#   rate (bench/gpu.py measures both). The snapshot's tmpfs mapping itself is page-locked
#   (`cudaHostRegister`, as torch's own checkpoint staging does for shared memory), so the copy lands in
#   the file with no staging buffer: no second host copy, no second state's worth of host memory (torch's
#   caching pinned allocator also rounds a block up to a power of two: 17 GB would take 32 GiB).
#   Registered when the mapping is made ready (`prepare`) or at the first copy, released before the
#   mapping is unmapped (`unpin`). Where the kernel refuses (a mapping that is not tmpfs, say) the copy
#   goes to pageable memory: `snapshot.unpinned` says so once, and `pinned` in `snapshot.stats`.
# - **the hold is on the GPU, not the CPU**: with the mapping page-locked the training thread itself
#   enqueues the copies on our stream at the snapshot (`launch`: microseconds, nothing waits) and the
#   optimizer's pre-hook makes the training stream wait for the copy's event (`gate`). The CPU never
#   blocks, so the next step's forward and backward, already queued, run on the GPU beside the copy, and
#   the step stalls only by what the copy outlasts them. bench/gpu.py's first H200 run showed why: with
#   the copy issued from a background thread and the pre-hook waiting on the CPU, the hook waited the
#   whole copy (the CPU reaches `optimizer.step()` long before the GPU has run the step's kernels), and the
#   cadence took that wait for a stall: K 72 for a 4 GB state whose copy the step hid entirely.
#   `stall()` is that real stall, timed by CUDA events (the training stream's arrival at the gate to the
#   copy's end), and is what the cadence counts. Without page-locking (`pin=False`, or refused) a
#   non-blocking copy would block the thread that issues it, so that copy stays on the background thread
#   and the hook waits on the CPU (`copy`), as on CPU.
#
# `DeviceCopy` counts the bytes and seconds of its copies: their rate is what the writer reports
# (`d2h_gb_per_s`; a memcpy's on CPU) and, through the background time, what sets the cadence's pipeline
# bound (`writer`). `pin=False` copies a GPU state into pageable memory (bench/gpu.py's comparison).


PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context, as torch registers


class DeviceCopy:
    """Copies (index, tensor) pairs into views of a mapping; one instance per snapshot writer."""

    def __init__(self, pin: bool = True, log: EventLog | None = None) -> None:
        self.pin = pin  # page-lock the mapping for a GPU state (False after a refusal)
        self.pinned = False  # a copy went to a page-locked mapping
        self.log = log
        self.seconds = 0.0  # of every copy so far (the writer resets them after the first snapshot)
        self.bytes = 0
        self._stream: Any = None
        self._ready: Any = None  # the training thread's event for the copy in flight
        self._registered: int | None = None  # the address of the mapping we page-locked
        self._flight: tuple[Any, Any, int, Any] | None = None  # (began, done, bytes, device) of a launch
        self._arrived: Any = None  # the training stream's event at the gate, for the launched copy
        self._timed: tuple[Any, Any] | None = None  # (arrived, done) of a finished copy, not yet read

    def mark(self, tensors: list[torch.Tensor]) -> None:
        """On the training thread, at the snapshot: the point of its CUDA stream the copy must follow."""
        device = _cuda_device(tensors)
        self._ready = None
        if device is not None:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))

    def prepare(self, mm: mmap.mmap, tensors: list[torch.Tensor]) -> None:
        """Page-lock the mapping now (background, beside the first steps) when the state is on a GPU."""
        if _cuda_device(tensors) is not None:
            self._register(mm)

    def copy(self, mm: mmap.mmap, views: list[torch.Tensor], pairs: list[tuple[int, torch.Tensor]],
             released: Callable[[], None]) -> None:
        """Copy each (i, tensor) into views[i] (which view `mm`); call `released` once no tensor is read
        any more. Raises what a copy raises (RuntimeError)."""
        tensors = [t for _, t in pairs]
        device = _cuda_device(tensors)
        t0 = time.monotonic()
        if device is not None:
            self._register(mm)
            self._copy_cuda(device, views, pairs)
        else:
            for i, tensor in pairs:
                views[i].copy_(tensor)
        self.seconds += time.monotonic() - t0
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        released()

    def launch(self, mm: mmap.mmap, views: list[torch.Tensor], pairs: list[tuple[int, torch.Tensor]]) -> bool:
        """On the training thread, at the snapshot: enqueue the copy of a GPU state into the page-locked
        mapping on our stream, after what the training stream has queued; True when launched (then
        `gate` before the next optimizer step and `wait` for its end). The few CPU tensors among them
        (Adam keeps its `step` counters on the CPU unless capturable) are copied here at once: one of
        them made the first GPU run fall back to the background thread for the whole state. False,
        launching nothing, for a CPU state or a mapping that is not page-locked (then `copy` on the
        background thread). Raises what a copy raises (RuntimeError)."""
        device = _cuda_device([t for _, t in pairs])
        if device is None:
            return False
        self._register(mm)
        if self._registered is None:
            return False
        ours = [(i, t) for i, t in pairs if t.device == device]
        for i, tensor in pairs:  # a CPU tensor (Adam's `step` counters) or another GPU's: copied now
            if tensor.device != device:
                views[i].copy_(tensor)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        began, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            began.record()
            for i, tensor in ours:
                tensor.record_stream(self._stream)  # its memory is not reused while we read it
                views[i].copy_(tensor, non_blocking=True)
            done.record()
        self._flight = (began, done, sum(t.numel() * t.element_size() for _, t in ours), device)
        self._arrived = None
        return True

    def gate(self) -> None:
        """In the optimizer's pre-hook (the training thread): the training stream waits, on the GPU, for
        the launched copy; the CPU goes on at once."""
        flight = self._flight  # read once: the background thread clears it when the copy is done
        if flight is None or self._arrived is not None:
            return
        done, device = flight[1], flight[3]
        try:
            current = torch.cuda.current_stream(device)
            arrived = torch.cuda.Event(enable_timing=True)
            arrived.record(current)
            current.wait_event(done)
            self._arrived = arrived
        except RuntimeError:  # the GPU-side hold failed: hold on the CPU, the update must not race the copy
            done.synchronize()

    def wait(self, released: Callable[[], None]) -> None:
        """On the background thread: block until the launched copy is complete, count it, `released()`."""
        assert self._flight is not None
        began, done, nbytes, _ = self._flight
        done.synchronize()
        self.seconds += began.elapsed_time(done) / 1e3
        self.bytes += nbytes
        self._timed = (self._arrived, done) if self._arrived is not None else None
        self._flight = None
        released()

    def stall(self) -> float | None:
        """Seconds the training stream waited at the gate for the last finished copy (0 when the copy
        ended first), once the GPU has got that far; None when unknown (no gate yet, or not reached)."""
        if self._timed is None or not self._timed[0].query():
            return None
        arrived, done = self._timed
        self._timed = None
        return max(0.0, arrived.elapsed_time(done) / 1e3)

    def _copy_cuda(self, device: torch.device, views: list[torch.Tensor],
                   pairs: list[tuple[int, torch.Tensor]]) -> None:
        """The CUDA branch: on our stream, after the training thread's event; returns when done."""
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._stream):
            if self._ready is not None:
                self._stream.wait_event(self._ready)
            for i, tensor in pairs:
                ours = tensor.device == device  # another GPU's tensor (rare): a synchronous copy
                if ours:
                    tensor.record_stream(self._stream)  # its memory is not reused while we read it
                views[i].copy_(tensor, non_blocking=ours)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def _register(self, mm: mmap.mmap) -> None:
        """Page-lock `mm` unless it is already, or pinning is off or was refused (reported once)."""
        if not self.pin:
            return
        address = _address(mm)
        if address == self._registered:
            return
        self.unpin()
        error = int(torch.cuda.cudart().cudaHostRegister(address, len(mm), PORTABLE))
        if error:
            self.pin = False
            if self.log is not None:
                self.log.emit("snapshot.unpinned", bytes=len(mm),
                              reason=f"cudaHostRegister: CUDA error {error}")
            return
        self._registered, self.pinned = address, True

    def unpin(self) -> None:
        """Release the page lock: before the mapping it covers is unmapped (`SnapshotFile.unmap`)."""
        if self._registered is not None:
            address, self._registered = self._registered, None
            error = int(torch.cuda.cudart().cudaHostUnregister(address))
            if error and self.log is not None:
                self.log.emit("snapshot.unpin_failed", reason=f"cudaHostUnregister: CUDA error {error}")

    def report(self, count: int) -> dict[str, Any]:
        """Per copy (of `count`): milliseconds, the rate, and whether the mapping was page-locked. Both
        figures keep 4 significant digits, not 3 decimals: a small state's copy (a few hundred bytes, or
        one slowed by a busy host) has a real rate below 0.0005 GB/s, which 3 decimals wrote as 0."""
        n = max(1, count)
        return {"d2h_ms": float(f"{1e3 * self.seconds / n:.4g}"), "pinned": self.pinned,
                "d2h_gb_per_s": float(f"{self.bytes / self.seconds / 1e9:.4g}") if self.seconds > 0 else None}


def _address(mm: mmap.mmap) -> int:
    """Where `mm` starts in memory (the ctypes view is released at once: the mapping can still close)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def _cuda_device(tensors: list[torch.Tensor]) -> torch.device | None:
    """The CUDA device of the first CUDA tensor, or None (always None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return next((t.device for t in tensors if t.is_cuda), None)


# --- the cadence --------------------------------------------------------------------------------------------
# How often to snapshot: every step unless that costs the training thread more than its budget.
#
# The cost of one snapshot is what the training thread pays for it: its own CPU time for the layout and the
# skeleton, plus any wall time it waited (for the previous snapshot's commit, or in the optimizer's pre-hook
# for the background copy). CPU time rather than wall time for the work, so a loaded machine's scheduling
# delays do not pass for the snapshot's cost; wall time for the waits, because then the step really stalls.
#
# K (snapshot every K steps) >= median cost / (budget * median step time), over the last WINDOW samples so
# one outlier moves nothing; raised at once, lowered only when half of K would do for the window's dearest
# sample with 25 % to spare (LOWER_MARGIN). Why both: a cost hovering at the budget, 0.93-1.08 ms of a
# 100 ms step for a 1 GB state on an H200, flapped K between 1 and 2 four times in 200 steps when the median
# alone decided; with the median and the margin it still flapped four times (2026-11-27: the window's
# median wandered 0.78-1.07 ms, the samples being two clusters, not noise around one value). A K one too
# high costs at most one step of work on a loss; a flapping K costs a log line and a wrong overhead. No
# verdict on the cost before SETTLE samples (the first snapshots pay one-time costs), except for a GPU's
# hold on the next optimizer step, timed by CUDA events (`writer`): the smallest such cost so far may
# raise K at once. A snapshot
# whose median cost is under FREE (1 ms: 1 % of the 100 ms step the goal is set on, and below the jitter of
# a step on a loaded machine) is taken every step whatever the step time: a small state's fixed cost
# (walking the state dict, about 0.3 ms here) must not cost a step of work on a loss. A fixed `every` turns
# the choice off.
#
# K is also at least the background time of a snapshot (its bytes over the measured copy rate: for a GPU
# state the device-to-host link, then the host copy and checksum) over the step time, from the first
# snapshot on: a snapshot due while the previous one is still being written would wait for it (the writer
# takes the next one at the first step end after it is done instead), so a K below that is one the writer
# cannot keep, and a 16 GB state whose copy takes seconds gets its K before it has stalled anything.
# Pure bookkeeping: no torch, no I/O.


WINDOW = 9
SETTLE = 5  # samples before K may change (the first snapshots pay one-time costs: imports, page faults)
FREE = 0.001
MAX_EVERY = 1000
LOWER_MARGIN = 1.25  # K is lowered only to a K the window's dearest cost fits (and FREE) with 25 % to spare


@dataclass
class Cadence:
    fixed: int | None = None  # a user's `every`; None: chosen
    budget: float = 0.01
    every: int = 1
    due: int = 1  # step ends until the next snapshot
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    costs: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    busy: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # background seconds
    _last_end: float | None = None

    def __post_init__(self) -> None:
        self.every = self.fixed or 1

    def step_ended(self, now: float) -> bool:
        """A step ended at `now` (monotonic seconds): True when a snapshot is due."""
        if self._last_end is not None:
            self.intervals.append(now - self._last_end)
        self._last_end = now
        self.due -= 1
        return self.due <= 0

    def started(self) -> None:
        self.due = self.every

    def record(self, cost: float | None, busy: float | None = None,
               timed: bool = False) -> tuple[int, int, float, float] | None:
        """Add one snapshot's cost to the training thread (None: not a measured one, a first touch of
        the memory) and the seconds its background work took; (new K, old K, median cost, median step)
        when K changes, else None. `timed`: the cost includes a GPU hold timed on the device (then the
        smallest cost so far may raise K before SETTLE samples)."""
        if cost is not None:
            self.costs.append(cost)
        if busy is not None:
            self.busy.append(busy)
        if self.fixed is not None or not self.intervals:
            return None
        step_m = statistics.median(self.intervals)
        cost_m = statistics.median(self.costs) if self.costs else 0.0
        cost_k = cost_m if len(self.costs) >= SETTLE else 0.0
        if len(self.costs) < SETTLE and timed and self.costs:
            # a GPU's hold timed by CUDA events carries no scheduling noise: K follows it at once, so a
            # 16 GB copy stalls one step, not SETTLE of them
            cost_k = min(self.costs)

        def need(cost: float) -> int:
            # a margin applies to FREE too: FREE is the budget at a 100 ms step
            k = math.ceil(cost / (self.budget * step_m)) if cost > FREE and step_m > 0 else 1
            if self.busy and step_m > 0:
                k = max(k, math.ceil(statistics.median(self.busy) / step_m))
            return min(MAX_EVERY, k)

        up = need(cost_k)
        if len(self.costs) < SETTLE and up <= self.every:
            return None  # before the cost has settled, only the pipeline bound may raise K
        # lowered only when the window's dearest snapshot fits with the margin to spare
        new = up if up > self.every else need(max(self.costs) * LOWER_MARGIN)
        if up > self.every or new <= self.every // 2:
            old, self.every = self.every, new
            self.due = min(self.due, new)
            return new, old, cost_m, step_m
        return None

    def step_time(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None
