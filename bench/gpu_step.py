"""The device side of bench/gpu.py: the device, a training step of a given state size, and the copy
microbenchmarks (device-to-host per GB, pageable and pinned; a copy in flight beside a step).

The step is what a user's loop does on a GPU: forward and backward of a model whose parameters and AdamW
state add up to the state size, real matmuls (`pad`) until the step takes the target time (the model's
own compute is small next to its memory), `optimizer.step()`, and a synchronise at the end (a loop that
logs its loss waits for the device there too). On CPU the same code runs with small sizes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

GB = 1e9


class Skip(Exception):
    """A part that cannot run here, or not in the time left: recorded with the reason, not an error."""

ADAM_BYTES_PER_PARAM = 12  # fp32 weight + exp_avg + exp_avg_sq (AdamW's state_dict and the model's)


@dataclass
class Device:
    kind: str  # "cuda" or "cpu"

    @property
    def torch(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free_bytes(self) -> int:
        """Free device memory (CUDA), or the host's available memory (CPU)."""
        if self.cuda:
            return int(torch.cuda.mem_get_info()[0])
        return host_available()

    def release(self) -> None:
        """Give cached memory back: the device's, and pinned host memory where torch can."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            empty_host = getattr(torch._C, "_host_emptyCache", None)
            if empty_host is not None:
                empty_host()


def host_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 when unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def timed(fn: Callable[[], Any], device: Device, reps: int) -> float:
    """Median seconds of `reps` runs of `fn`, each synchronised."""
    times = []
    for _ in range(reps):
        device.sync()
        t0 = time.perf_counter()
        fn()
        device.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StepModel:
    """A model and AdamW whose state_dicts hold about `state_bytes`, and a step padded to `step_s`."""

    def __init__(self, device: Device, state_bytes: float, step_s: float, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.device = device
        params = max(1, int(state_bytes / ADAM_BYTES_PER_PARAM))
        width = max(64, min(8192, int((params / 4) ** 0.5) // 64 * 64))
        layers = max(1, round(params / width ** 2))
        dev = device.torch
        mods: list[torch.nn.Module] = []
        for i in range(layers):
            mods.append(torch.nn.Linear(width, width, bias=False, device=dev))
            if i < layers - 1:
                mods.append(torch.nn.Tanh())
        self.model = torch.nn.Sequential(*mods)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.x = torch.randn(16, width, device=dev)
        size = 4096 if device.cuda else 128
        self.a = torch.randn(size, size, device=dev)
        self.b = torch.randn(size, size, device=dev)
        self.c = torch.empty(size, size, device=dev)
        self.width, self.layers, self.pad, self.step_s = width, layers, 0, step_s
        self.base_s = self.pad_s = 0.0
        self.step()  # AdamW's state exists from here: the state has its size
        self.calibrate()

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        for _ in range(self.pad):
            torch.mm(self.a, self.b, out=self.c)
        self.optimizer.step()
        self.device.sync()

    def compute(self, count: int) -> None:
        """`count` padding matmuls alone (the overlap test's step)."""
        for _ in range(count):
            torch.mm(self.a, self.b, out=self.c)

    def calibrate(self) -> None:
        """Matmuls enough to bring the step to `step_s` (none when the model alone takes longer): the
        step and one matmul timed, then the count corrected twice on the padded step as measured."""
        self.pad = 0
        self.step()  # warm: the first matmuls set up their libraries
        self.base_s = timed(self.step, self.device, 5)
        count = 4
        while True:
            self.pad_s = timed(lambda n=count: self.compute(n), self.device, 3) / count
            if count * self.pad_s >= 0.2 * self.step_s or count >= 4096:
                break
            count *= 4
        self.pad = max(0, round((self.step_s - self.base_s) / self.pad_s))
        for _ in range(2):
            measured = timed(self.step, self.device, 3)
            if self.pad == 0 or abs(measured / self.step_s - 1) < 0.03:
                break
            per = max(1e-6, (measured - self.base_s) / self.pad)  # one matmul, as the step runs it
            self.pad = max(0, round((self.step_s - self.base_s) / per))

    def state_bytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for s in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
        return total

    def describe(self) -> dict[str, Any]:
        return {"layers": self.layers, "width": self.width, "state_bytes": self.state_bytes(),
                "model_step_ms": round(1e3 * self.base_s, 3), "pad_matmuls": self.pad,
                "pad_matmul_ms": round(1e3 * self.pad_s, 4)}


def copy_rates(device: Device, nbytes: int, reps: int = 3) -> dict[str, Any]:
    """Device-to-host copy time per GB into pageable memory (faulted in first, as the snapshot's
    mapping is) and into pinned memory. On CPU the source is host memory: a memcpy, and no pinned."""
    out: dict[str, Any] = {"bytes": nbytes, "pageable": _copy_rate(device, nbytes, False, reps)}
    out["pinned"] = (_copy_rate(device, nbytes, True, reps) if device.cuda
                     else {"skipped": "no CUDA: pinned memory needs a device"})
    device.release()
    return out


def _copy_rate(device: Device, nbytes: int, pinned: bool, reps: int) -> dict[str, float]:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device.torch)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst.zero_()  # faulted in, as the snapshot's mapping is
    return _rate(nbytes, timed(lambda: dst.copy_(src, non_blocking=pinned), device, reps))


def _rate(nbytes: int, seconds: float) -> dict[str, float]:
    return {"ms_per_gb": round(1e3 * seconds * GB / nbytes, 3), "gb_per_s": round(nbytes / seconds / GB, 3),
            "ms": round(1e3 * seconds, 3)}


def overlap(device: Device, model: StepModel, nbytes: int, pinned: bool, reps: int = 3) -> dict[str, Any]:
    """Whether a device-to-host copy runs beside a step: the step (the padding matmuls, one step's
    worth) alone, the copy alone (on a stream of its own, issued from another thread as the snapshot
    writer does), and both at once. overlap = the time saved against running them one after the other,
    over the shorter one's time: 1 when the shorter one is hidden entirely, 0 when they serialise."""
    count = max(1, round(model.step_s / model.pad_s)) if model.pad_s > 0 else 1
    src = torch.ones(nbytes, dtype=torch.uint8, device=device.torch)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and device.cuda)
    dst.zero_()
    stream = torch.cuda.Stream() if device.cuda else None

    def copy() -> None:
        if stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    def both() -> None:
        thread = threading.Thread(target=copy)
        thread.start()
        model.compute(count)
        device.sync()
        thread.join()

    step_s = timed(lambda: model.compute(count), device, reps)
    copy_s = timed(copy, device, reps)
    both_s = timed(both, device, reps)
    shorter = min(step_s, copy_s)
    raw = (step_s + copy_s - both_s) / shorter if shorter > 0 else 0.0
    return {"bytes": nbytes, "pinned": pinned and device.cuda, "step_ms": round(1e3 * step_s, 3),
            "copy_ms": round(1e3 * copy_s, 3), "both_ms": round(1e3 * both_s, 3),
            "step_slowdown_pct": round(100 * (both_s / step_s - 1), 2) if copy_s < step_s else None,
            "overlap": round(min(1.0, max(0.0, raw)), 3), "overlap_raw": round(raw, 3)}


def _prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # resolved here, in the parent: the child between fork and exec only calls it


def die_with_parent() -> None:
    """In a child, before exec: SIGKILL when the bench dies (its watchdog exits at once, and a child
    left running would hold a port, a GPU context or the machine's memory). Linux only; elsewhere nothing."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def shm_free() -> tuple[str, int]:
    """The tmpfs directory snapshots go to (as the agent's, /dev/shm) and its free bytes."""
    path = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    st = os.statvfs(path)
    return path, st.f_bavail * st.f_frsize
