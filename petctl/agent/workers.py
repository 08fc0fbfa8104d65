"""The local worker processes of one node: start them with torchrun's environment, watch, stop.

Workers share the agent's process group on purpose: a frozen or killed "instance" (the whole group)
takes its workers with it, exactly as a vanished host would. They also die with the agent
(PR_SET_PDEATHSIG) so no orphan keeps a GPU or a gloo socket busy after the agent is gone.
Their output is piped through one reader thread each, so lines from several workers never interleave
mid-line and the agent can follow progress events (steps, checkpoints) without touching torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from petctl.agent.warm_worker import READY
from petctl.core.eventlog import parse_line

PR_SET_PDEATHSIG = 1


def pdeathsig() -> Callable[[], None] | None:
    """A preexec function that makes the child die with its parent (Linux only; else None)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    return preexec


def worker_base_env() -> dict[str, str]:
    """The agent's environment for a worker, with Python's fault handler on unless the user set it.

    A worker that dies in native code (SIGSEGV, or SIGABRT from `terminate called ...` at exit) then
    leaves every thread's Python stack in the node log, so the log says which thread and where, instead
    of one line and an exit code of -6.
    """
    return {"PYTHONFAULTHANDLER": "1", **os.environ}


@dataclass
class WorkerSpec:
    """What to run, identical on every node; the per-rank env is computed by `WorkerGroup.start`."""

    cmd: list[str]  # [python, -u, script, *args]
    cwd: str
    nproc: int
    base_env: dict[str, str] = field(default_factory=dict)
    # Imported ahead by warm workers. torch._dynamo is what a first optimizer step pulls in (measured:
    # ~2 s on top of torch), so it belongs here too.
    preload: tuple[str, ...] = ("torch", "torch.distributed", "torch.optim", "torch._dynamo")


class WarmPool:
    """Workers started ahead of time with torch imported, waiting for their rank on stdin.

    The agent runs every entrypoint as `python -u FILE args`, and a warm worker runs FILE the same way
    (`runpy.run_path`), so any entrypoint can be handed to one, whatever its name. A warm worker that died
    while waiting is discarded, never handed out. Readiness comes on a pipe of its own (see
    `warm_worker.signal_ready`), never on the worker's output.
    """

    def __init__(self, spec: WorkerSpec, preexec: Callable[[], None] | None) -> None:
        self.spec = spec
        self.preexec = preexec
        self.ready: list[subprocess.Popen] = []
        self._warm: dict[int, _Readiness] = {}  # pid -> whether (and once) its imports are done

    @property
    def usable(self) -> bool:
        cmd = self.spec.cmd
        return len(cmd) >= 3 and cmd[1] == "-u" and not cmd[2].startswith("-")

    @property
    def full(self) -> bool:
        """Every slot holds a live worker (or the pool cannot be used at all): nothing to refill."""
        return not self.usable or sum(1 for p in self.ready if p.poll() is None) >= self.spec.nproc

    def fill(self) -> int:
        """Start workers until `nproc` wait in the pool; returns how many were started now."""
        if not self.usable:
            return 0
        self.ready = [p for p in self.ready if p.poll() is None]
        env = {**worker_base_env(), **self.spec.base_env, "PYTHONUNBUFFERED": "1"}
        started = 0
        while len(self.ready) < self.spec.nproc:
            read_fd, write_fd = os.pipe()
            try:
                proc = subprocess.Popen(
                    [self.spec.cmd[0], "-u", "-m", "petctl.agent.warm_worker", ",".join(self.spec.preload),
                     str(write_fd)],
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


@dataclass
class GroupResult:
    """Outcome of a worker group that is no longer running."""

    exit_codes: dict[int, int]  # local rank -> exit code (negative: killed by that signal)

    @property
    def succeeded(self) -> bool:
        return all(code == 0 for code in self.exit_codes.values())

    def first_failure(self) -> tuple[int, int] | None:
        for local_rank, code in sorted(self.exit_codes.items()):
            if code != 0:
                return local_rank, code
        return None


class WorkerGroup:
    """`nproc` worker processes for one rendezvous round."""

    def __init__(self, spec: WorkerSpec, out: IO[str], on_event: Callable[[dict], None] | None = None,
                 pool: WarmPool | None = None):
        self.spec = spec
        self.pool = pool
        self.warm_started = 0
        self.warm_ready = 0  # of those, how many had finished their imports
        self.out = out
        self.on_event = on_event
        self.procs: dict[int, subprocess.Popen] = {}
        self._readers: list[threading.Thread] = []
        self._out_lock = threading.Lock()
        self._preexec = pdeathsig()
        self.started_at = 0.0

    def start(self, *, node_rank: int, num_nodes: int, master_addr: str, master_port: int,
              restart_count: int, max_restarts: int, run_id: str, extra_env: dict[str, str]) -> None:
        nproc = self.spec.nproc
        world = num_nodes * nproc
        self.started_at = time.time()
        for local_rank in range(nproc):
            rank = node_rank * nproc + local_rank
            env = {
                **worker_base_env(),
                **self.spec.base_env,
                **extra_env,
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": str(node_rank),
                "GROUP_WORLD_SIZE": str(num_nodes),
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(world),
                "ROLE_NAME": "default",
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
                "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "PYTHONUNBUFFERED": "1",
            }
            taken = self.pool.take() if self.pool is not None else None
            proc = taken[0] if taken else None
            if taken and taken[1]:
                self.warm_ready += 1
            if proc is not None:
                order = {"env": env, "cwd": self.spec.cwd, "argv": self.spec.cmd[2:]}
                try:
                    assert proc.stdin is not None
                    proc.stdin.write((json.dumps(order) + "\n").encode())
                    proc.stdin.close()
                    self.warm_started += 1
                except (BrokenPipeError, OSError):
                    proc.kill()
                    proc.wait()
                    proc = None
            if proc is None:
                proc = subprocess.Popen(
                    self.spec.cmd, cwd=self.spec.cwd, env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=self._preexec,
                )
            self.procs[local_rank] = proc
            reader = threading.Thread(target=self._pump, args=(proc,), name=f"worker-out-{local_rank}",
                                      daemon=True)
            reader.start()
            self._readers.append(reader)

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            with self._out_lock:
                try:
                    self.out.write(line if line.endswith("\n") else line + "\n")
                    self.out.flush()
                except (ValueError, OSError):
                    pass
            if self.on_event is not None:
                record = parse_line(line)
                if record is not None:
                    self.on_event(record)
        proc.stdout.close()

    def poll(self) -> GroupResult | None:
        """None while any worker runs (or none were started); the result once all have exited.

        A group with one failed worker is reported as soon as that worker fails: its peers are likely
        blocked in a collective and would otherwise hold the node until a timeout.
        """
        if not self.procs:
            return None
        codes = {lr: p.poll() for lr, p in self.procs.items()}
        if any(c is not None and c != 0 for c in codes.values()):
            return GroupResult({lr: (c if c is not None else 0) for lr, c in codes.items()
                                if c is not None})
        if all(c is not None for c in codes.values()):
            return GroupResult({lr: int(c) for lr, c in codes.items()})  # type: ignore[arg-type]
        return None

    def some_succeeded(self) -> bool:
        """At least one worker exited 0 (while others may still be running)."""
        return any(p.poll() == 0 for p in self.procs.values())

    @property
    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def signal_all(self, sig: int) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def stop(self, grace: float) -> dict[int, int]:
        """SIGTERM every worker, SIGKILL what is left after `grace`; returns exit codes."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.running and time.monotonic() < deadline:
            time.sleep(0.02)
        self.signal_all(signal.SIGKILL)
        codes = {lr: p.wait() for lr, p in self.procs.items()}
        for reader in self._readers:
            reader.join(timeout=1.0)
        return codes

    def wait_exit(self, timeout: float) -> bool:
        """Wait up to `timeout` for every worker to exit on its own; True if they all did."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.running
