"""How a snapshot's background tensors reach the mapped file: a GPU state on a stream of its own, into
the mapping pinned in place.

A CPU tensor is copied into its place in the mapping as before. For CUDA tensors:
- **its own stream**: on the training thread's stream the copy would queue behind the next step's
  kernels and hold them up; on a stream of its own it runs on the copy engine beside them. The stream
  first waits for an event the training thread recorded at the snapshot (`mark`), after the step's
  `optimizer.step()`, so the copy reads the state after that step and nothing later.
- **pinned memory, in place**: a device-to-host copy into pageable memory goes through the driver's
  bounce buffer and blocks the calling thread; into page-locked memory it is one DMA at the link's
  rate (bench/gpu.py measures both). The snapshot's tmpfs mapping itself is page-locked
  (`cudaHostRegister`, as torch's own checkpoint staging does for shared memory), so the copy lands in
  the file with no staging buffer: no second host copy, no second state's worth of host memory (torch's
  caching pinned allocator also rounds a block up to a power of two: 17 GB would take 32 GiB).
  Registered when the mapping is made ready (`prepare`) or at the first copy, released before the
  mapping is unmapped (`unpin`). Where the kernel refuses (a mapping that is not tmpfs, say) the copy
  goes to pageable memory: `snapshot.unpinned` says so once, and `pinned` in `snapshot.stats`.
- **the hold is on the GPU, not the CPU**: with the mapping page-locked the training thread itself
  enqueues the copies on our stream at the snapshot (`launch`: microseconds, nothing waits) and the
  optimizer's pre-hook makes the training stream wait for the copy's event (`gate`). The CPU never
  blocks, so the next step's forward and backward, already queued, run on the GPU beside the copy, and
  the step stalls only by what the copy outlasts them. bench/gpu.py's first H200 run showed why: with
  the copy issued from a background thread and the pre-hook waiting on the CPU, the hook waited the
  whole copy (the CPU reaches `optimizer.step()` long before the GPU has run the step's kernels), and the
  cadence took that wait for a stall: K 72 for a 4 GB state whose copy the step hid entirely.
  `stall()` is that real stall, timed by CUDA events (the training stream's arrival at the gate to the
  copy's end), and is what the cadence counts. Without page-locking (`pin=False`, or refused) a
  non-blocking copy would block the thread that issues it, so that copy stays on the background thread
  and the hook waits on the CPU (`copy`), as on CPU.

`DeviceCopy` counts the bytes and seconds of its copies: their rate is what the writer reports
(`d2h_gb_per_s`; a memcpy's on CPU) and, through the background time, what sets the cadence's pipeline
bound (`snapcadence`). `pin=False` copies a GPU state into pageable memory (bench/gpu.py's comparison).
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable
from typing import Any

import torch

from petctl.core.eventlog import EventLog

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
        """Per copy (of `count`): milliseconds, the rate, and whether the mapping was page-locked."""
        n = max(1, count)
        return {"d2h_ms": round(1e3 * self.seconds / n, 3), "pinned": self.pinned,
                "d2h_gb_per_s": round(self.bytes / self.seconds / 1e9, 3) if self.seconds > 0 else None}


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
