"""P8 on the device: what petctl's in-memory snapshot tier costs a training step at its defaults.

The writer is `SnapshotWriter` as `Checkpointer` makes it under the agent (K chosen by the cadence,
parameters and optimizer state copied beside the next step; for a GPU state, on a stream of its own
into the page-locked mapping), writing into a file in /dev/shm, as the agent's snapshot directory is.
Blocks of steps with and without snapshots alternate, as bench/snapcost.py does on CPU; in a block with
snapshots every step but the last offers one (`take`: the cadence decides), so a copy started in the
block is waited for by a step of the same block. Overhead = mean step of the blocks with / mean of the
blocks without - 1, the first block of each kind left out (warm-up). At the end the snapshot on file is
read back as a resume would (header and checksum) and must name the last step snapshotted.

The blocks measure the first steps, while the cadence is still finding K; what a long run pays at the K
picked is the measured cost of one snapshot to the step (the training thread's part and the GPU's hold
on the next optimizer step) over K steps (`overhead_at_k_pct`). `exact` checks the snapshot's bytes:
snapshot after a step, run the next step at once (its optimizer update must wait for the copy), and the
file must hold the state as it was after the first step, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu_step import Device, Skip, StepModel, host_available, shm_free
from petctl.elastic import State
from petctl.elastic.snapshots.codec import decode, flatten
from petctl.elastic.snapshots.resume import SnapshotReader
from petctl.elastic.snapshots.writer import DeviceCopy, SnapshotWriter
from petctl.io.eventlog import EventLog

JOB = "bench-gpu"


def snapshot_dir(state_bytes: float, scratch: Path) -> tuple[Path, str]:
    """Where the snapshot file goes and a note: /dev/shm (tmpfs, as under the agent), or `scratch` (a
    disk's page cache: the kernel may refuse to page-lock it, and its writeback is extra) when the tmpfs
    is too small, as a container's often is. Raises Skip when the host's memory cannot hold the
    snapshot."""
    need = state_bytes * 1.1
    if host_available() < need:
        raise Skip(f"host memory: {host_available() / 1e9:.1f} GB available, {need / 1e9:.1f} GB needed "
                   "for the snapshot file")
    path, free = shm_free()
    if free >= state_bytes * 1.05 + (64 << 20):
        return Path(path), "tmpfs, as the agent's snapshot directory"
    if shutil.disk_usage(scratch).free < state_bytes * 1.1:
        raise Skip(f"{path} has {free / 1e9:.1f} GB free and {scratch} too little for "
                   f"{state_bytes / 1e9:.1f} GB")
    return scratch, f"{path} has only {free / 1e9:.1f} GB free: a file in {scratch} (page cache) instead"


def run(device: Device, model: StepModel, base: Path, steps: int, block: int,
        pin: bool = True) -> dict[str, Any]:
    """One P8 measurement on `model`'s state, the snapshot file in `base`; `pin=False`: the mapping left
    pageable (what page-locking it buys)."""
    state = State(model=model.model, optimizer=model.optimizer, extra={"step": -1})
    directory = Path(tempfile.mkdtemp(prefix="petctl-gpubench-", dir=base))
    quiet = EventLog("gpu-bench", stream=open(os.devnull, "w"))  # noqa: SIM115
    events: list[dict[str, Any]] = []
    quiet.add_sink(events.append)
    writer = SnapshotWriter(directory / "state.snap", JOB, 1, 0, 1, quiet)
    if not pin:
        writer.device = DeviceCopy(pin=False, log=quiet)
        writer.file.before_unmap = writer.device.unpin
    times: dict[bool, list[float]] = {False: [], True: []}
    last, closed = None, False
    try:
        t0 = time.perf_counter()
        writer.prepare(state)
        if writer._pending is not None:  # wait here, so the steps measured are the steady state
            writer._pending.result()
        prepare_s = time.perf_counter() - t0
        for step in range(steps):
            snap = (step // block) % 2 == 1
            t0 = time.perf_counter()
            model.step()
            state.extra["step"] = step
            if snap and step % block != block - 1 and writer.take(step, state):
                last = step
            if step >= 2 * block:
                times[snap].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        writer.close()
        close_s, closed = time.perf_counter() - t0, True
        offer = SnapshotReader(directory / "state.snap", JOB, 2, 0, quiet).offer()
    finally:
        if not closed:
            writer.close()
        shutil.rmtree(directory, ignore_errors=True)
    without, with_ = statistics.mean(times[False]), statistics.mean(times[True])
    report = writer.report()
    return {
        "steps": steps, "block": block, "pin": pin,
        "step_ms_without": round(1e3 * without, 3), "step_ms_with": round(1e3 * with_, 3),
        "median_step_ms_without": round(1e3 * statistics.median(times[False]), 3),
        "median_step_ms_with": round(1e3 * statistics.median(times[True]), 3),
        "overhead_pct": round(100 * (with_ / without - 1), 3),
        "overhead_at_k_pct": round(100 * (report["blocked_ms"] + report["hook_wait_ms"])
                                   / (report["every"] * 1e3 * without), 3),
        "every": report["every"], "snapshots": report["snapshots"],
        "steps_per_snapshot": round(len(times[True]) / max(1, report["snapshots"]), 2),
        "k_changes": [{k: e[k] for k in ("every", "was", "cost_ms", "step_ms")}
                      for e in events if e["event"] == "snapshot.every"],
        "prepare_s": round(prepare_s, 3), "close_s": round(close_s, 3),
        "d2h_ms_per_gb": round(1e3 / report["d2h_gb_per_s"], 3) if report["d2h_gb_per_s"] else None,
        "verified": offer is not None and offer.step == last and report["disabled"] is None,
        "last_step": last,
        "offered_step": None if offer is None else offer.step,
        "unpinned_events": [e.get("reason") for e in events if e["event"] == "snapshot.unpinned"],
        "writer": report,
    }


def exact(device: Device, model: StepModel, base: Path) -> dict[str, Any]:
    """Snapshot after one step, run the next at once, and compare the file with the state after the
    first step, tensor by tensor (bitwise). The check that the copy is ordered before the next update."""
    state = State(model=model.model, optimizer=model.optimizer, extra={"step": -1})
    directory = Path(tempfile.mkdtemp(prefix="petctl-gpubench-exact-", dir=base))
    quiet = EventLog("gpu-bench", stream=open(os.devnull, "w"))  # noqa: SIM115
    writer = SnapshotWriter(directory / "state.snap", JOB, 1, 0, 1, quiet, every=1)
    try:
        writer.prepare(state)
        model.step()
        state.extra["step"] = 0
        expect: list = []
        flatten(state.state_dict(), expect, [])
        expect = [t.detach().to("cpu", copy=True) for t in expect]
        if not writer.take(0, state):
            raise RuntimeError("the writer took no snapshot at a fixed every=1")
        model.step()  # its optimizer.step() must wait for the copy: the file must not see this update
        model.step()
        writer.close()
        reader = SnapshotReader(directory / "state.snap", JOB, 2, 0, quiet)
        offer = reader.offer()
        if offer is None:
            return {"verified": False, "why": "no snapshot offered"}
        payload, header = reader.load(offer.step)
        got: list = []
        flatten(decode(payload, header.data_length, header.meta_offset, header.meta_length), got, [])
        differ = sum(1 for a, b in zip(expect, got, strict=True) if not torch.equal(a, b))
        now = _live(state)
        moved = sum(1 for a, t in zip(expect, now, strict=True) if not torch.equal(a, t.detach().cpu()))
        # moved > 0: the steps after the snapshot did change the state, so equality is not vacuous
        return {"verified": differ == 0 and moved > 0, "tensors": len(expect), "differ": differ,
                "changed_since": moved, "pinned": writer.device.pinned}
    finally:
        writer.close()
        shutil.rmtree(directory, ignore_errors=True)


def _live(state: State) -> list:
    out: list = []
    flatten(state.state_dict(), out, [])
    return out
