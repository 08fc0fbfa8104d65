"""The local worker processes of one node: start them with torchrun's environment, watch, stop.

Workers share the agent's process group on purpose: a frozen or killed "instance" (the whole group)
takes its workers with it, exactly as a vanished host would. They also die with the agent
(PR_SET_PDEATHSIG, `petctl.io.procs.die_with_parent`) so no orphan keeps a GPU or a gloo socket busy
after the agent is gone. Their output is piped through one reader thread each, so lines from several
workers never interleave mid-line and the agent can follow progress events (steps, checkpoints) without
touching torch. Each worker's last lines that are not events (its stderr is merged into its stdout: a
traceback, a `RuntimeError: ...`) are kept too, so a failure can say why (`error_tail`). What they run
and their environment: `workerspec.py`; workers started ahead of time: `warm_pool.py`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from petctl.agent.warm_pool import WarmPool
from petctl.agent.workerspec import RoundPlacement, WorkerSpec, rank_env
from petctl.core.eventlog import parse_line
from petctl.io.procs import die_with_parent
from petctl.io.wait import wait_until

__all__ = ["GroupResult", "WorkerGroup", "WorkerSpec"]

ERROR_TAIL_LINES = 20  # the failing worker's last lines kept for `workers.failed` and `petctl status`
ERROR_LINE_CHARS = 400  # ... each cut to this length, so the status record stays small
TAIL_DRAIN = 1.0  # how long `error_tail` waits for an exited worker's last lines to be read
STOP_POLL = 0.02  # how often a stopping group is checked (a restart waits on it: keep it short)
EXIT_POLL = 0.05


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
        self._readers: dict[int, threading.Thread] = {}  # local rank -> its output reader
        self._tails: dict[int, deque[str]] = {}  # local rank -> its last lines that are not events
        self._out_lock = threading.Lock()
        self._preexec = die_with_parent(signal.SIGKILL)
        self.started_at = 0.0
        self.output_at: float | None = None  # monotonic: the latest line any worker printed

    def start(self, *, node_rank: int, num_nodes: int, master_addr: str, master_port: int,
              restart_count: int, max_restarts: int, run_id: str, extra_env: dict[str, str]) -> None:
        placement = RoundPlacement(node_rank, num_nodes, master_addr, master_port, restart_count,
                                   max_restarts, run_id)
        self.started_at = time.time()
        for local_rank in range(self.spec.nproc):
            env = rank_env(self.spec, placement, local_rank, extra_env)
            proc = self._hand_to_warm(env)
            if proc is None:
                proc = subprocess.Popen(
                    self.spec.cmd, cwd=self.spec.cwd, env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=self._preexec,
                )
            self.procs[local_rank] = proc
            self._tails[local_rank] = deque(maxlen=ERROR_TAIL_LINES)
            reader = threading.Thread(target=self._pump, args=(proc, self._tails[local_rank]),
                                      name=f"worker-out-{local_rank}", daemon=True)
            reader.start()
            self._readers[local_rank] = reader

    def _hand_to_warm(self, env: dict[str, str]) -> subprocess.Popen | None:
        """Give a pooled worker its orders (env, cwd, argv); None when the pool has none to give."""
        taken = self.pool.take() if self.pool is not None else None
        if taken is None:
            return None
        proc, ready = taken
        order = {"env": env, "cwd": self.spec.cwd, "argv": self.spec.cmd[2:]}
        try:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(order) + "\n").encode())
            proc.stdin.close()
        except OSError:  # it died since it was taken (BrokenPipeError): start a fresh worker instead
            proc.kill()
            proc.wait()
            return None
        self.warm_started += 1
        self.warm_ready += int(ready)
        return proc

    def _pump(self, proc: subprocess.Popen, tail: deque[str]) -> None:
        assert proc.stdout is not None
        in_launcher = False  # the line after a launcher frame is that frame's source line
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.output_at = time.monotonic()
            record = parse_line(line)
            with self._out_lock:
                keep = record is None and line.strip() and not (in_launcher and line.startswith("    "))
                in_launcher = launcher_frame(line)
                if keep and not in_launcher:
                    tail.append(line.rstrip()[:ERROR_LINE_CHARS])
                try:
                    self.out.write(line if line.endswith("\n") else line + "\n")
                    self.out.flush()
                except (ValueError, OSError):  # our stream is closed (shutting down): drop the line, but
                    pass  # keep draining the pipe so the worker never blocks on a full one
            if record is not None and self.on_event is not None:
                self.on_event(record)
        proc.stdout.close()

    def error_tail(self, local_rank: int) -> list[str]:
        """The last lines (at most ERROR_TAIL_LINES) worker `local_rank` printed that are not events.

        Called once the worker has exited: its reader gets up to TAIL_DRAIN seconds to read what was
        still in the pipe (the traceback is written last), so the lines are complete; a reader still
        busy after that (a grandchild holding the pipe open) yields what was read by then."""
        reader = self._readers.get(local_rank)
        if reader is not None:
            reader.join(timeout=TAIL_DRAIN)
        with self._out_lock:
            return list(self._tails.get(local_rank, ()))

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
        wait_until(lambda: not self.running, grace, STOP_POLL)
        self.signal_all(signal.SIGKILL)
        codes = {lr: p.wait() for lr, p in self.procs.items()}
        for reader in self._readers.values():
            reader.join(timeout=1.0)
        return codes

    def wait_exit(self, timeout: float) -> bool:
        """Wait up to `timeout` for every worker to exit on its own; True if they all did."""
        return wait_until(lambda: not self.running, timeout, EXIT_POLL)


LAUNCHER_FILES = ("/runpy.py", "/petctl/agent/warm_worker.py")


def launcher_frame(line: str) -> bool:
    """A traceback frame of the machinery that started the script (runpy, the warm worker), not of the
    script: left out of the error tail, so its 20 lines are the user's."""
    text = line.strip()
    return text.startswith('File "') and any(f'{name}"' in text for name in LAUNCHER_FILES)
