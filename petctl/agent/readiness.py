"""A node gets ready to train before it registers: warm workers, and the newest checkpoint on local disk.

Run beside the warm pool's imports, in a child process (`python -m petctl.elastic.prefetch`: the agent
never imports petctl.elastic), so by the time the node's heartbeat asks the others to re-form it holds
the code, warm workers and the checkpoint on local disk. Best effort and bounded: a failed or slow
prefetch costs only that the first resume downloads as usual; it is reported either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from petctl.agent.warm_pool import WARM_WAIT, WarmPool, refill
from petctl.agent.workerspec import WorkerSpec
from petctl.core.eventlog import EventLog
from petctl.core.spec import JobSpec
from petctl.io.procs import die_with_parent


def get_ready(spec: JobSpec, worker_spec: WorkerSpec, work_dir: Path, events: EventLog, out: IO[str],
              services: contextlib.ExitStack) -> WarmPool | None:
    """Before the node registers (its heartbeat is what makes the others re-form), get ready to train:
    the code is fetched already; prefetch the newest checkpoint and warm the workers (torch imported),
    side by side, for `WARM_WAIT` at most. Returns the warm pool (closed with `services`), if any."""
    t0 = time.monotonic()
    prefetch = Prefetch(spec.checkpoint_url, work_dir / "cache", {**os.environ, **spec.env}, events, out,
                        die_with_parent())
    prefetch.start()
    pool = WarmPool(worker_spec, die_with_parent(), warm_spares(spec.env)) if spec.warm_workers else None
    if pool is not None:
        services.callback(pool.close)
        pool.fill(worker_spec.nproc)
        ready = pool.wait_ready(WARM_WAIT)
        events.emit("workers.warm_ready", count=ready, seconds=round(time.monotonic() - t0, 3))
        refill(pool, True, 0, events)  # the spares, if any: importing while the node registers
    prefetch.finish(WARM_WAIT - (time.monotonic() - t0))
    return pool


def warm_spares(env: Mapping[str, str]) -> int:
    """Spare warm workers per slot, from the job's `PETCTL_WARM_SPARES` (default 0; not a number: 0)."""
    value = env.get("PETCTL_WARM_SPARES", "0").strip()
    return min(int(value), 4) if value.isdigit() else 0


class Prefetch:
    """One prefetch child: `start` it, `finish` it (bounded) and pass its event line on."""

    def __init__(self, url: str, cache_dir: Path, env: Mapping[str, str], events: EventLog, out: IO[str],
                 preexec: Callable[[], None] | None = None) -> None:
        self.url = url
        self.cache_dir = cache_dir
        self.env = dict(env)
        self.events = events
        self.out = out
        self.preexec = preexec
        self.proc: subprocess.Popen[str] | None = None
        self._t0 = 0.0

    def start(self) -> None:
        """Spawn the child; a spawn failure is reported, never raised (the resume downloads instead)."""
        if not self.url:
            return
        self._t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "petctl.elastic.prefetch", "--url", self.url, "--cache-dir",
                 str(self.cache_dir)], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, preexec_fn=self.preexec)
        except OSError as e:
            self.events.emit("checkpoint.prefetch_failed", error=f"spawn: {e}", url=self.url)

    def finish(self, timeout: float) -> int | None:
        """Wait up to `timeout` s; pass the child's event lines on to the node log and the sinks. The
        prefetched step, or None (nothing to fetch, failed, or too slow: then the child is killed)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        try:
            output, _ = proc.communicate(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            self.events.emit("checkpoint.prefetch_failed", error=f"not done in {timeout:.0f}s",
                             seconds=round(time.monotonic() - self._t0, 3), url=self.url)
            return None
        step = None
        for line in output.splitlines():
            self.out.write(line + "\n")
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a warning printed by an import: in the node log, not an event
            if isinstance(record, dict) and "event" in record:
                self.events.forward(record)
                if record["event"] == "checkpoint.prefetched" and isinstance(record.get("step"), int):
                    step = record["step"]
        self.out.flush()
        return step
