"""Warm start on the device: launch -> first training step for a cold worker and for petctl's warm worker
(`petctl.agent.warm_worker`, started as the agent's `WarmPool` starts it), and a world-1 re-form -> step
again with the job's backend (NCCL on CUDA, gloo on CPU).

- `cold`: `python -u bench/gpu_worker.py`, timed from the moment it is started.
- `warm`: petctl's warm worker as the agent runs it today (torch, torch.distributed, torch.optim and
  torch._dynamo imported ahead), timed from the moment its orders are written to its stdin.
- `forked`: the same warm worker forked from the agent's fork server (`WarmPool`, the default since
  2026-11-27): one interpreter did the imports, the worker is a fork of it. `fork_reason` says why the pool
  spawned instead, if it did (a preload that initialised CUDA, say).
- `warm_cuda_runtime`: the same plus bench/gpu_warmup.py in `runtime` mode (the CUDA runtime and NCCL
  loaded ahead, no context: safe for any pooled worker).
- `warm_cuda_context`: plus the CUDA context on its device (`context` mode: safe only when a pooled
  worker's device is known ahead).
The re-form is the cold worker's: its group destroyed and made again on a new port, then a step.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.gpu_step import die_with_parent
from petctl.agent.forkserver import ForkedProc
from petctl.agent.warm_worker import READY
from petctl.agent.workers import WarmPool, WorkerSpec
from petctl.io.procs import free_port

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "gpu_worker.py"
PRELOAD = ",".join(WorkerSpec.__dataclass_fields__["preload"].default)
MILESTONES = ("worker.imported", "worker.device", "worker.pg_ready", "worker.step")
VARIANTS = ("cold", "warm", "forked", "warm_cuda_runtime", "warm_cuda_context")


def _env(device: str, reform: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BENCH_DEVICE": device, "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": os.pathsep.join(
               p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    if reform:
        env["BENCH_REFORM_PORT"] = str(free_port())
    return env


def _read(proc: subprocess.Popen | ForkedProc, lines: list[dict[str, Any]], tail: list[str]) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        text = raw.decode(errors="replace").strip()
        if text.startswith("{") and '"event"' in text:
            try:
                lines.append(json.loads(text))
                continue
            except ValueError:
                pass
        tail.append(text)
        del tail[:-20]


class Launch:
    """One worker process of a variant: started, (warm) waited for until ready, then given its orders."""

    def __init__(self, variant: str, device: str) -> None:
        self.variant, self.warm = variant, variant != "cold"
        self.env = _env(device, reform=not self.warm)
        self.lines: list[dict[str, Any]] = []
        self.tail: list[str] = []
        self.out: dict[str, Any] = {"variant": variant}
        self.t0 = time.time()
        self.pool: WarmPool | None = None
        self.proc: subprocess.Popen | ForkedProc | None = None  # a forked variant's, once taken from its pool
        if variant == "forked":
            base = {k: self.env[k] for k in ("BENCH_DEVICE", "PYTHONPATH")}
            self.pool = WarmPool(WorkerSpec(cmd=[sys.executable, "-u", str(WORKER)], cwd=str(REPO), nproc=1,
                                            base_env=base), die_with_parent, out=sys.stderr)
            self.pool.fill()  # the fork server's imports, then one fork
            return
        if self.warm:
            preload = PRELOAD + (",bench.gpu_warmup" if variant.startswith("warm_cuda") else "")
            spawn_env = {**self.env, "BENCH_WARM": "context" if variant == "warm_cuda_context" else "runtime"}
            self.read_fd, write_fd = os.pipe()
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "petctl.agent.warm_worker", preload, str(write_fd), str(WORKER)],
                cwd=REPO, env=spawn_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, pass_fds=(write_fd,), preexec_fn=die_with_parent)
            os.close(write_fd)
        else:
            self.proc = subprocess.Popen([sys.executable, "-u", str(WORKER)], cwd=REPO, env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.reader = threading.Thread(target=_read, args=(self.proc, self.lines, self.tail), daemon=True)
        self.reader.start()

    def ready(self, timeout_s: float) -> bool:
        """Warm: wait (bounded) until the worker says its imports are done (False: it exited first, or
        took longer than `timeout_s`)."""
        if self.pool is not None:
            ok = self.pool.wait_ready(timeout_s) == 1
            taken = self.pool.take()
            self.out.update(forked=self.pool.forking, fork_reason=self.pool.fork_reason)
            self.out["warmup_s"] = round(time.time() - self.t0, 3)
            if taken is None:
                return False
            self.proc = taken[0]
            self.reader = threading.Thread(target=_read, args=(self.proc, self.lines, self.tail), daemon=True)
            self.reader.start()
            return ok
        with os.fdopen(self.read_fd, "rb") as pipe:
            ok = bool(select.select([pipe], [], [], timeout_s)[0]) and pipe.read(len(READY)) == READY
        self.out["warmup_s"] = round(time.time() - self.t0, 3)  # off the critical path: before the orders
        return ok

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """Give a warm worker its orders (the clock starts there), wait for the worker, read its lines."""
        assert self.proc is not None  # started, or (forked) taken from its pool by `ready`
        try:
            if self.warm:
                order = {"env": self.env, "cwd": str(REPO), "argv": [str(WORKER)]}
                assert self.proc.stdin is not None
                self.t0 = time.time()
                self.proc.stdin.write((json.dumps(order) + "\n").encode())
                self.proc.stdin.flush()
            rc = self.proc.wait(timeout_s)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            rc = None
        self.stop()
        return self._result(rc)

    def stop(self) -> None:
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self.reader.join(5)
        if self.pool is not None:
            self.pool.close()

    def _result(self, rc: int | None) -> dict[str, Any]:
        out, seen = self.out, {e["event"]: e for e in self.lines}
        out["rc"] = rc
        if rc != 0 or "worker.step" not in seen:
            out["error"] = f"exit {rc}: " + " | ".join(self.tail[-5:])
            return out
        out["launch_to_step_s"] = round(seen["worker.step"]["ts"] - self.t0, 3)
        out["milestones_s"] = {m: round(seen[m]["ts"] - self.t0, 3) for m in MILESTONES if m in seen}
        if "reform.step" in seen:
            started = seen["reform.step"]["started"]
            out["reform"] = {"backend": seen["reform.pg_ready"]["backend"],
                             "pg_s": round(seen["reform.pg_ready"]["ts"] - started, 3),
                             "to_step_s": round(seen["reform.step"]["ts"] - started, 3)}
        return out


def run(device: str, timeout_s: float, deadline: float) -> dict[str, Any]:
    """Every variant once. The warm workers are started first, together, and waited for until ready (as
    the agent's pool fills while the job trains); then the cold worker runs alone, then each warm one
    gets its orders in turn, the others idle. Variants that cannot run here (no CUDA) are skipped with
    the reason; so is the rest when the time left before `deadline` (unix time) is short."""
    out: dict[str, Any] = {}
    warm: list[Launch] = []
    try:
        for variant in VARIANTS[1:]:
            if variant.startswith("warm_cuda") and device != "cuda":
                out[variant] = {"variant": variant, "skipped": "no CUDA: nothing to initialise ahead"}
            else:
                warm.append(Launch(variant, device))
        ready = {w.variant: w.ready(max(1.0, min(timeout_s, deadline - time.time()))) for w in warm}
        for variant in VARIANTS:
            if variant in out:
                continue
            left = deadline - time.time()
            if left < min(timeout_s, 30):
                out[variant] = {"variant": variant, "skipped": f"over the time budget ({left:.0f} s left)"}
                continue
            if variant == "cold":
                out[variant] = Launch(variant, device).finish(min(timeout_s, left))
                continue
            launch = next(w for w in warm if w.variant == variant)
            if not ready[variant]:
                launch.stop()
                out[variant] = {**launch._result(None), "error": "not ready in time, or exited before: "
                                + " | ".join(launch.tail[-5:])}
                continue
            out[variant] = launch.finish(min(timeout_s, left))
    finally:
        for w in warm:
            w.stop()
    cold = out.get("cold", {})
    if "reform" in cold:
        out["reform"] = cold["reform"]
    return {v: out[v] for v in (*VARIANTS, "reform") if v in out}
