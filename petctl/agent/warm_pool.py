"""Workers started ahead of time with torch imported, so a restart does not wait for the import.

Why: on a restart the slowest phase is not the rendezvous (tens of ms) but a fresh Python importing
torch (seconds). The pool keeps `nproc` workers (`petctl.agent.warm_worker`) waiting; `WorkerGroup`
takes one per rank when a round forms and sends it its environment and command line on stdin.

Spares (`PETCTL_WARM_SPARES` in the job's environment, per slot): a round takes `nproc` workers and the
pool refills only once the round trains (imports beside a starting round would slow it), so a second
disruption within the refill's imports (seconds; tens for a framework job on a busy host) found no warm
worker. With a spare per slot the pool keeps `nproc * (1 + spares)`: the spares start once the node's
first `nproc` are ready, and the next round takes them while the refill is still importing. Each costs
an idle interpreter with the script's imports (torch: a few hundred MB of host memory).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from petctl.agent.warm_worker import READY
from petctl.agent.workerspec import WorkerSpec, worker_base_env
from petctl.core.eventlog import EventLog

WARM_WAIT = 60.0  # longest a node waits for its warm workers' imports


class WarmPool:
    """Workers started ahead of time with torch imported, waiting for their rank on stdin.

    The agent runs every entrypoint as `python -u FILE args`, and a warm worker runs FILE the same way
    (`runpy.run_path`), so any entrypoint can be handed to one, whatever its name. A warm worker that died
    while waiting is discarded, never handed out. Readiness comes on a pipe of its own (see
    `warm_worker.signal_ready`), never on the worker's output.
    """

    def __init__(self, spec: WorkerSpec, preexec: Callable[[], None] | None, spares: int = 0) -> None:
        self.spec = spec
        self.preexec = preexec
        self.size = spec.nproc * (1 + max(0, spares))  # workers the pool keeps when full
        self.ready: list[subprocess.Popen] = []
        self._warm: dict[int, _Readiness] = {}  # pid -> whether (and once) its imports are done
        self.given_up = False  # a refill had no worker ready (they die at import): stop refilling
        self.closed = False

    @property
    def usable(self) -> bool:
        cmd = self.spec.cmd
        return len(cmd) >= 3 and cmd[1] == "-u" and not cmd[2].startswith("-")

    @property
    def full(self) -> bool:
        """Every slot holds a live worker (or the pool cannot be used at all): nothing to refill."""
        return (not self.usable or self.given_up
                or sum(1 for p in self.ready if p.poll() is None) >= self.size)

    def fill(self, up_to: int | None = None) -> int:
        """Start workers until `up_to` (default: the pool's size) wait in the pool; returns how many were
        started now."""
        if not self.usable:
            return 0
        self.ready = [p for p in self.ready if p.poll() is None]
        env = {**worker_base_env(), **self.spec.base_env, "PYTHONUNBUFFERED": "1"}
        started = 0
        while len(self.ready) < min(self.size, up_to or self.size):
            read_fd, write_fd = os.pipe()
            try:
                proc = subprocess.Popen(
                    [self.spec.cmd[0], "-u", "-m", "petctl.agent.warm_worker", ",".join(self.spec.preload),
                     str(write_fd), os.path.join(self.spec.cwd, self.spec.cmd[2])],
                    cwd=self.spec.cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, preexec_fn=self.preexec, pass_fds=(write_fd,))
            except BaseException:
                os.close(read_fd)
                raise
            finally:
                os.close(write_fd)  # the child holds the only write end: its exit means EOF here
            warm = self._warm[proc.pid] = _Readiness()
            threading.Thread(target=self._await_ready, args=(read_fd, warm), name="warm-ready",
                             daemon=True).start()
            self.ready.append(proc)
            started += 1
        return started

    @staticmethod
    def _await_ready(read_fd: int, warm: _Readiness) -> None:
        """Blocks until the worker signals on its ready pipe, or exits (EOF: never ready)."""
        try:
            with os.fdopen(read_fd, "rb") as pipe:
                warm.ready = pipe.read(len(READY)) == READY
        finally:
            warm.settled.set()

    def wait_ready(self, timeout: float) -> int:
        """Wait (bounded) until every pooled worker has finished importing or died; returns how many
        are ready."""
        deadline = time.monotonic() + timeout
        for proc in self.ready:
            readiness = self._warm.get(proc.pid)
            if readiness is not None:
                readiness.settled.wait(max(0.0, deadline - time.monotonic()))
        return sum(1 for p in self.ready if self._is_ready(p))

    def readiness(self, proc: subprocess.Popen) -> _Readiness | None:
        """The handshake of a pooled worker (None once handed out)."""
        return self._warm.get(proc.pid)

    def _is_ready(self, proc: subprocess.Popen) -> bool:
        readiness = self._warm.get(proc.pid)
        return readiness is not None and readiness.ready and proc.poll() is None

    def take(self) -> tuple[subprocess.Popen, bool] | None:
        """A pooled worker and whether it had finished importing (if not, the round waits for it).

        A worker whose pipe closed without the signal is exiting even if it cannot be reaped yet (the
        pipe closes a moment before the process is gone): it is discarded, never handed out.
        """
        while self.ready:
            proc = self.ready.pop(0)
            readiness = self._warm.pop(proc.pid, None)
            warm = readiness is not None and readiness.ready and proc.poll() is None
            if readiness is not None and readiness.settled.is_set() and not readiness.ready:
                proc.kill()
                proc.wait()
                continue
            if proc.poll() is None:
                return proc, warm
        return None

    def close(self) -> None:
        self.closed = True
        for proc in self.ready:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.ready = []


@dataclass
class _Readiness:
    """A warm worker's handshake: `settled` once it signalled or died, `ready` if it signalled."""

    settled: threading.Event = field(default_factory=threading.Event)
    ready: bool = False


def refill(pool: WarmPool | None, due: bool, round_no: int, events: EventLog) -> None:
    """Refill the pool once `due` (the round's first step was seen: off the restart's critical path, or
    some seconds into the round). One report per refill, never one per call (a pool that cannot fill
    starts nothing)."""
    if pool is None or pool.full or not due:
        return
    if pool.fill():
        threading.Thread(target=_report_warm, args=(pool, round_no, events), daemon=True).start()


def _report_warm(pool: WarmPool, round_no: int, events: EventLog) -> None:
    """One line when the refilled pool is ready: from then on a restart skips every import."""
    t0 = time.monotonic()
    # The handshakes of the workers this refill started: a round may take one from the pool meanwhile
    # (it then waits for its imports itself), which is not a death.
    watched = [w for w in (pool.readiness(p) for p in pool.ready) if w is not None]
    ready = pool.wait_ready(WARM_WAIT)
    events.emit("workers.warm_ready", count=ready, round=round_no, seconds=round(time.monotonic() - t0, 3))
    died = bool(watched) and all(w.settled.is_set() and not w.ready for w in watched)
    if died and not pool.closed:  # every one died importing: refilling again would only start more that die
        pool.given_up = True
        events.emit("workers.warm_given_up", round=round_no,
                    reason="no warm worker became ready; restarts start cold workers")
