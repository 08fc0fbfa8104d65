"""What bench/gpu.py ran on: the device's name, driver, CUDA, NCCL and torch versions, the host's memory."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

import torch

from bench.gpu_step import host_available, shm_free


def device_info(kind: str) -> dict[str, Any]:
    shm, shm_bytes = shm_free()
    info: dict[str, Any] = {
        "kind": kind, "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "host_available_gb": round(host_available() / 1e9, 1),
        "shm": shm, "shm_free_gb": round(shm_bytes / 1e9, 1)}
    if kind != "cuda":
        return {**info, "name": f"CPU: {_cpu_model()}", "driver": None, "nccl": None}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    nccl = torch.cuda.nccl.version()
    info.update({"name": props.name, "memory_gb": round(props.total_memory / 1e9, 1),
                 "multiprocessors": props.multi_processor_count,
                 "nccl": ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl),
                 "cudnn": torch.backends.cudnn.version(), **_nvidia_smi()})
    return info


def _nvidia_smi() -> dict[str, Any]:
    """The driver version and the PCIe link (generation, width) from nvidia-smi; None where it says
    nothing."""
    fields = ("driver_version", "pcie.link.gen.max", "pcie.link.width.max")
    try:
        run = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        values = [v.strip() for v in run.stdout.splitlines()[0].split(",")] if run.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, IndexError):
        values = []
    got = dict(zip(fields, values, strict=False))
    return {"driver": got.get("driver_version"), "pcie_gen": got.get("pcie.link.gen.max"),
            "pcie_width": got.get("pcie.link.width.max")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
