"""A node's workers: what they run (`WorkerSpec`, each rank's env), the processes of one round
(`WorkerGroup`), the warm pool started ahead, and getting ready before the node registers.

Sections: the worker spec and env; the warm pool; the worker group (this docstring); readiness (warm workers
and the checkpoint prefetch before registering).

The local worker processes of one node: start them with torchrun's environment, watch, stop.

Workers share the agent's process group on purpose: a frozen or killed "instance" (the whole group)
takes its workers with it, exactly as a vanished host would. They also die with the agent
(PR_SET_PDEATHSIG, `petctl.io.procs.die_with_parent`) so no orphan keeps a GPU or a gloo socket busy
after the agent is gone. Their output is piped through one reader thread each, so lines from several
workers never interleave mid-line and the agent can follow progress events (steps, checkpoints) without
touching torch. Each worker's last lines that are not events (its stderr is merged into its stdout: a
traceback, a `RuntimeError: ...`) are kept too, so a failure can say why (`error_tail`). What they run
and their environment: `WorkerSpec` and `rank_env`; workers started ahead of time: `WarmPool` (above).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import IO

from petctl.agent.forkserver import ForkedProc, ForkServer
from petctl.agent.warm_worker import ENV_WARM_NICE, EXITING, READY, raise_priority
from petctl.core.eventlog import parse_events
from petctl.core.snapshotrecord import ENV_SNAPSHOT_DIR
from petctl.core.spec import JobSpec
from petctl.io.eventlog import EventLog
from petctl.io.procs import die_with_parent, host_cores, wait_until

# --- what workers run ---------------------------------------------------------------------------------------
# What a node runs: the worker command shared by every node, and each worker's environment.
#
# Pure data and functions (no processes here): `WorkerGroup` starts workers from these, `WarmPool` starts
# them ahead of time. The environment is torchrun's, so a script written for torchrun runs unchanged.

def worker_base_env() -> dict[str, str]:
    """The agent's environment for a worker, with Python's fault handler on unless the user set it.

    A worker that dies in native code (SIGSEGV, or SIGABRT from `terminate called ...` at exit) then
    leaves every thread's Python stack in the node log, so the log says which thread and where, instead
    of one line and an exit code of -6.
    """
    return {"PYTHONFAULTHANDLER": "1", **os.environ}


# torchrun's thread default (torch/distributed/run.py): a node that runs more than one worker sets
# OMP_NUM_THREADS=1 for them unless it is set already, "to avoid your system being overloaded". Each worker's
# torch otherwise sizes its intra-op pool to every core of the host, so `nproc` workers run `nproc` times as
# many threads as there are cores, and OpenMP's idle threads spin while they wait: measured here on 2 cores,
# an HF Trainer job of 2 workers spent 2.8 times the CPU (47.8 s against 17.0) and took 1.8 times as long.
# A script tuned under torchrun gets the threads it got there.
OMP_THREADS = "OMP_NUM_THREADS"


def torchrun_threads(nproc: int, host_env: Mapping[str, str], job_env: Mapping[str, str]) -> dict[str, str]:
    """`{"OMP_NUM_THREADS": "1"}` where torchrun would set it (more than one worker per node, and neither
    the host's environment nor the job's sets it), else nothing."""
    if nproc > 1 and OMP_THREADS not in host_env and OMP_THREADS not in job_env:
        return {OMP_THREADS: "1"}
    return {}


@dataclass
class WorkerSpec:
    """What to run, identical on every node; the per-rank env is computed by `rank_env`."""

    cmd: list[str]  # [python, -u, script, *args]
    cwd: str
    nproc: int
    base_env: dict[str, str] = field(default_factory=dict)
    # Imported ahead by warm workers. torch._dynamo is what a first optimizer step pulls in (measured:
    # ~2 s on top of torch), so it belongs here too.
    preload: tuple[str, ...] = ("torch", "torch.distributed", "torch.optim", "torch._dynamo")


@dataclass(frozen=True)
class RoundPlacement:
    """Where this node's workers sit in a round: what torchrun tells each worker through its env."""

    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    run_id: str


def rank_env(spec: WorkerSpec, placement: RoundPlacement, local_rank: int,
             extra_env: dict[str, str]) -> dict[str, str]:
    """The full environment of local worker `local_rank` (torchrun's variables over the user's)."""
    nproc = spec.nproc
    world = placement.num_nodes * nproc
    rank = placement.node_rank * nproc + local_rank
    return {
        **worker_base_env(),
        **spec.base_env,
        **extra_env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(placement.node_rank),
        "GROUP_WORLD_SIZE": str(placement.num_nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "MASTER_ADDR": placement.master_addr,
        "MASTER_PORT": str(placement.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(placement.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(placement.max_restarts),
        "TORCHELASTIC_RUN_ID": placement.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "PYTHONUNBUFFERED": "1",
    }


def round_env(spec: JobSpec, node_id: str, round_no: int, control_dir: Path, work_dir: Path,
              snapshot_dir: Path | None) -> dict[str, str]:
    """What petctl adds to torchrun's environment for one round's workers (the contract in
    docs/ARCHITECTURE.md, "Worker environment"): the job, this instance, the round, the shared checkpoint
    location, the node's dirs and the world sizes the job may take."""
    snapshots = {ENV_SNAPSHOT_DIR: str(snapshot_dir)} if snapshot_dir is not None else {}
    return {"PETCTL_JOB": spec.name, "PETCTL_NODE_ID": node_id, "PETCTL_ROUND": str(round_no),
            "PETCTL_CHECKPOINT_URL": spec.checkpoint_url, "PETCTL_CONTROL_DIR": str(control_dir),
            "PETCTL_CACHE_DIR": str(work_dir / "cache"),
            # The world sizes (ranks) the job may take: ElasticSampler refuses, at start, a global batch
            # that one of them cannot split (petctl.elastic.sampler reads these names).
            "PETCTL_MIN_WORLD_SIZE": str(spec.min_size * spec.nproc_per_node),
            "PETCTL_MAX_WORLD_SIZE": str(spec.max_size * spec.nproc_per_node), **snapshots}


# --- the warm pool ------------------------------------------------------------------------------------------
# Workers started ahead of time with torch imported, so a restart does not wait for the import.
#
# Why: on a restart the slowest phase is not the rendezvous (tens of ms) but a fresh Python importing
# torch (seconds). The pool keeps `nproc` workers (`petctl.agent.warm_worker`) waiting; `WorkerGroup`
# takes one per rank when a round forms and sends it its environment and command line on stdin. They are
# forked from the node's fork server (`petctl.agent.forkserver`: the imports done once, each worker a fork of
# milliseconds) where it can fork; otherwise each is spawned and imports on its own, and the refill's timing
# below is what keeps those imports off a starting round.
#
# When to refill (`refill_due`): a round takes `nproc` workers, and a second disruption within the refill's
# imports (seconds; tens for a framework job on a busy host) finds no warm worker. So the refill starts when
# the round forms, where that cannot slow the round's own start: at the node's priority where the host has a
# core to spare per import; elsewhere, where the job asks for it (`warm_yield`), at a low CPU priority
# (`REFILL_NICE`), raised back to the node's once the round trains (its first step, or REFILL_AFTER into it:
# the moment the refill used to start) and by each worker itself the moment its order arrives, even
# mid-import (warm_worker.py), so the refill is never later than it was. Otherwise (the default on a host
# without cores to spare, or where the agent cannot raise a priority back) it waits for the round to train.
#
# Spares (`PETCTL_WARM_SPARES` in the job's environment, per slot): the pool keeps `nproc * (1 + spares)`,
# so the next round takes spares while the refill is still importing. They import together with the node's
# first `nproc` where the host has a core for each (`spare_cores`), else once those are ready. Each costs an
# idle interpreter with the script's imports (torch: a few hundred MB of host memory).

WARM_WAIT = 60.0  # longest a node waits for its warm workers' imports
REFILL_AFTER = 10.0  # a refill that has to wait for the round's first step waits this long at most
REFILL_NICE = 10  # added to a refill worker's nice value while it imports (Linux: per thread)


@dataclass(frozen=True)
class RefillLook:
    """What decides whether and how the warm pool refills now (`refill_due`)."""

    missing: int  # workers the pool lacks (0: full, or it cannot be used)
    niced: int  # pooled workers still importing at the low priority
    round_age: float  # seconds since this round's workers were handed out
    step_seen: bool  # the round trains: its first step (or a framework's progress report) was seen
    spare_cores: int  # the host's cores beyond this node's workers and its agent
    yielding: bool  # the agent can lower a refill's priority and raise it back
    forking: bool = False  # the pool forks its workers from its fork server: a refill imports nothing


class Refill(Enum):
    WAIT = "wait"  # not now: the imports would slow the round's start
    YIELD = "yield"  # start what is missing, at the low priority
    NOW = "now"  # start what is missing at the node's priority, and raise the ones at the low one to it


def refill_due(look: RefillLook) -> Refill:
    """What the pool does now: nothing when it is full and none of its workers yields; at once where the pool
    forks its workers (a fork imports nothing: milliseconds of CPU, pages shared until written); at the
    node's priority once the round trains (its first step, or REFILL_AFTER into it: a script that reports no
    steps) or where the host has a core for each import; before that at the low priority where the agent
    can raise it back, else not yet."""
    if look.missing <= 0 and look.niced <= 0:
        return Refill.WAIT
    if (look.forking or look.step_seen or look.round_age >= REFILL_AFTER
            or look.spare_cores >= look.missing + look.niced):
        return Refill.NOW
    return Refill.YIELD if look.yielding else Refill.WAIT


def can_restore_priority() -> bool:
    """Whether a thread of ours that lowered its CPU priority can raise it back (root, CAP_SYS_NICE or
    RLIMIT_NICE allow it). Probed in a throwaway thread: Linux nice values are per thread, so the agent's
    own threads are never touched. Never raises."""
    result: list[bool] = []

    def probe() -> None:
        try:
            tid = threading.get_native_id()
            base = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, base + 1))
            os.setpriority(os.PRIO_PROCESS, tid, base)
            result.append(True)
        except (AttributeError, OSError):
            result.append(False)

    thread = threading.Thread(target=probe, name="nice-probe", daemon=True)
    thread.start()
    thread.join(5.0)
    return bool(result and result[0])


WorkerProc = subprocess.Popen | ForkedProc  # a worker process, spawned or forked


class WarmPool:
    """Workers started ahead of time with torch imported, waiting for their rank on stdin.

    The agent runs every entrypoint as `python -u FILE args`, and a warm worker runs FILE the same way
    (`runpy.run_path`), so any entrypoint can be handed to one, whatever its name. A warm worker that died
    while waiting is discarded, never handed out. Readiness comes on a pipe of its own (see
    `warm_worker.signal_ready`), never on the worker's output.
    """

    def __init__(self, spec: WorkerSpec, preexec: Callable[[], None] | None, spares: int = 0,
                 cores: int | None = None, yielding: bool = False, fork: bool = True,
                 out: IO[str] | None = None) -> None:
        self.spec = spec
        self.preexec = preexec
        self.size = spec.nproc * (1 + max(0, spares))  # workers the pool keeps when full
        self.spare_cores = (host_cores() if cores is None else cores) - spec.nproc - 1  # less the agent's
        self.yielding = yielding  # refills may import at REFILL_NICE (see can_restore_priority)
        self._niced: dict[int, int] = {}  # pooled low-priority worker's pid -> the nice value it returns to
        self.ready: list[WorkerProc] = []
        self._warm: dict[int, _Readiness] = {}  # pid -> whether (and once) its imports are done
        self.given_up = False  # a refill had no worker ready (they die at import): stop refilling
        self.closed = False
        # The fork server (forkserver.py): tried once, on the first fill, where the platform has one.
        self.fork = fork and sys.platform.startswith("linux") and hasattr(socket, "send_fds")
        self.server: ForkServer | None = None
        self.fork_reason = "" if self.fork else "the job spawns its warm workers (PETCTL_WARM_FORK=0)"
        self.out = out  # where the fork server's own output goes (its imports' warnings); None: ours
        self.fork_reported = False  # `fork_reason` was reported (report_forking)

    @property
    def forking(self) -> bool:
        """The pool's workers are forked from its fork server (so far: it may still fail, see fill)."""
        return self.server is not None and self.fork

    @property
    def usable(self) -> bool:
        cmd = self.spec.cmd
        return len(cmd) >= 3 and cmd[1] == "-u" and not cmd[2].startswith("-")

    @property
    def full(self) -> bool:
        """Every slot holds a live worker (or the pool cannot be used at all): nothing to refill."""
        return (not self.usable or self.given_up
                or sum(1 for p in self.ready if p.poll() is None) >= self.size)

    def refill_look(self, round_age: float, step_seen: bool) -> RefillLook:
        """The pool's side of `refill_due`, during a round `round_age` seconds old."""
        live = sum(1 for p in self.ready if p.poll() is None)
        missing = 0 if not self.usable or self.given_up else max(0, self.size - live)
        niced = sum(1 for p in self.ready if p.pid in self._niced and p.poll() is None)
        return RefillLook(missing=missing, niced=niced, round_age=round_age, step_seen=step_seen,
                          spare_cores=self.spare_cores, yielding=self.yielding, forking=self.forking)

    def hurry(self) -> int:
        """Raise the pooled low-priority workers back to the node's priority; how many were refused."""
        niced, self._niced = self._niced, {}
        return sum(1 for pid, nice in niced.items() if not raise_priority(pid, nice))

    def fill(self, up_to: int | None = None, nice: int = 0) -> int:
        """Start workers until `up_to` (default: the pool's size) wait in the pool; returns how many were
        started now. Forked from the fork server where it runs (started here the first time, which waits up
        to WARM_WAIT for its imports); spawned otherwise, importing at `nice` more than ours (they lower it
        again at their orders). A fork server that cannot fork, or fails, is given up for good
        (`fork_reason` says why) and the pool spawns from then on."""
        if not self.usable:
            return 0
        self.ready = [p for p in self.ready if p.poll() is None]
        wanted = min(self.size, up_to or self.size) - len(self.ready)
        if wanted <= 0:
            return 0
        server = self._fork_server()
        if server is not None:
            try:
                for proc, ready_fd in server.fork(wanted):
                    self._track(proc, ready_fd)
                return wanted
            except OSError as e:
                self._give_up_forking(f"the fork server failed: {e}")
                self.ready = [p for p in self.ready if p.poll() is None]
        env = self._env()
        base = os.getpriority(os.PRIO_PROCESS, 0) if nice > 0 else 0
        if nice > 0:
            env[ENV_WARM_NICE] = str(base)
        preexec = _niced(self.preexec, nice) if nice > 0 else self.preexec
        started = 0
        while len(self.ready) < min(self.size, up_to or self.size):
            read_fd, write_fd = os.pipe()
            try:
                proc = subprocess.Popen(
                    [self.spec.cmd[0], "-u", "-m", "petctl.agent.warm_worker", ",".join(self.spec.preload),
                     str(write_fd), self.script],
                    cwd=self.spec.cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, preexec_fn=preexec, pass_fds=(write_fd,))
            except BaseException:
                os.close(read_fd)
                raise
            finally:
                os.close(write_fd)  # the child holds the only write end: its exit means EOF here
            self._track(proc, read_fd)
            if nice > 0:
                self._niced[proc.pid] = base
            started += 1
        return started

    @property
    def script(self) -> str:
        return os.path.join(self.spec.cwd, self.spec.cmd[2])

    def _env(self) -> dict[str, str]:
        """The environment a pooled worker (or the fork server) imports in, before its order replaces it."""
        return {**worker_base_env(), **self.spec.base_env, "PYTHONUNBUFFERED": "1"}

    def _track(self, proc: WorkerProc, ready_fd: int) -> None:
        """Pool `proc`, watching its ready pipe."""
        warm = self._warm[proc.pid] = _Readiness()
        threading.Thread(target=self._await_ready, args=(ready_fd, warm), name="warm-ready",
                         daemon=True).start()
        self.ready.append(proc)

    def _fork_server(self) -> ForkServer | None:
        """The running fork server, started (and waited for) on the first call; None where the pool spawns."""
        if not self.fork:
            return None
        if self.server is None:
            self.server = ForkServer(self.spec.cmd[0], self.spec.preload, self.script, self.spec.cwd,
                                     self._env(), self.preexec, self.out)
            reason = self.server.start(WARM_WAIT)
            if reason:
                self._give_up_forking(reason)
                return None
        return self.server

    def _give_up_forking(self, reason: str) -> None:
        self.fork = False
        self.fork_reason = reason
        if self.server is not None:
            self.server.close()

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

    def readiness(self, proc: WorkerProc) -> _Readiness | None:
        """The handshake of a pooled worker (None once handed out)."""
        return self._warm.get(proc.pid)

    def _is_ready(self, proc: WorkerProc) -> bool:
        readiness = self._warm.get(proc.pid)
        return readiness is not None and readiness.ready and proc.poll() is None

    def take(self) -> tuple[WorkerProc, bool] | None:
        """A pooled worker and whether it had finished importing (if not, the round waits for it).

        A worker whose pipe closed without the signal is exiting even if it cannot be reaped yet (the
        pipe closes a moment before the process is gone): it is discarded, never handed out.
        """
        while self.ready:
            proc = self.ready.pop(0)
            readiness = self._warm.pop(proc.pid, None)
            self._niced.pop(proc.pid, None)  # it raises its own priority at its order
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
        if self.server is not None:
            self.server.close()


def _niced(preexec: Callable[[], None] | None, nice: int) -> Callable[[], None]:
    """`preexec`, then `nice` more (in the child, before it runs anything)."""
    def run() -> None:
        if preexec is not None:
            preexec()
        os.nice(nice)
    return run


@dataclass
class _Readiness:
    """A warm worker's handshake: `settled` once it signalled or died, `ready` if it signalled."""

    settled: threading.Event = field(default_factory=threading.Event)
    ready: bool = False


def refill(pool: WarmPool | None, due: Refill, round_no: int, events: EventLog) -> None:
    """Act on `refill_due`. One report per refill, never one per call (a pool that cannot fill starts
    nothing); a priority that could not be raised back is reported each time it is refused (once per
    refill: the workers are forgotten either way)."""
    if pool is None or due is Refill.WAIT:
        return
    if due is Refill.NOW and (refused := pool.hurry()):
        events.emit("workers.warm_priority_refused", round=round_no, workers=refused,
                    reason="the warm workers import at the low CPU priority until their orders")
    if not pool.full and pool.fill(nice=REFILL_NICE if due is Refill.YIELD else 0):
        threading.Thread(target=_report_warm, args=(pool, round_no, events), daemon=True).start()
    report_forking(pool, events, round_no)


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


# --- the worker group ---------------------------------------------------------------------------------------

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
        self.procs: dict[int, WorkerProc] = {}
        self._readers: dict[int, threading.Thread] = {}  # local rank -> its output reader
        self._tails: dict[int, deque[str]] = {}  # local rank -> its last lines that are not events
        self._out_lock = threading.Lock()
        self._preexec = die_with_parent(signal.SIGKILL)
        self.started_at = 0.0
        self.output_at: float | None = None  # monotonic: the latest line any worker printed
        self._exiting_at: dict[int, float] = {}  # local rank -> monotonic: its script said it finished

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
            reader = threading.Thread(target=self._pump, args=(local_rank, proc, self._tails[local_rank]),
                                      name=f"worker-out-{local_rank}", daemon=True)
            reader.start()
            self._readers[local_rank] = reader

    def _hand_to_warm(self, env: dict[str, str]) -> WorkerProc | None:
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

    def _pump(self, local_rank: int, proc: WorkerProc, tail: deque[str]) -> None:
        assert proc.stdout is not None
        in_launcher = False  # the line after a launcher frame is that frame's source line
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.output_at = time.monotonic()
            records = parse_events(line)
            with self._out_lock:
                keep = not records and line.strip() and not (in_launcher and line.startswith("    "))
                in_launcher = launcher_frame(line)
                if keep and not in_launcher:
                    tail.append(line.rstrip()[:ERROR_LINE_CHARS])
                try:
                    self.out.write(line if line.endswith("\n") else line + "\n")
                    self.out.flush()
                except (ValueError, OSError):  # our stream is closed (shutting down): drop the line, but
                    pass  # keep draining the pipe so the worker never blocks on a full one
            for record in records:
                if record.get("event") == EXITING:
                    self._exiting_at[local_rank] = time.monotonic()
                if self.on_event is not None:
                    self.on_event(record)
        proc.stdout.close()

    def exiting_since(self) -> float | None:
        """When the last of the running workers said its script finished (`worker.exiting`), if every
        running one has; None otherwise, or when none runs. From then on they are only exiting."""
        running = [lr for lr, p in self.procs.items() if p.poll() is None]
        if not running or any(lr not in self._exiting_at for lr in running):
            return None
        return max(self._exiting_at[lr] for lr in running)

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


LAUNCHER_FILES = ("/runpy.py", "/petctl/agent/warm_worker.py", "/petctl/agent/forkserver.py")


def launcher_frame(line: str) -> bool:
    """A traceback frame of the machinery that started the script (runpy, the warm worker), not of the
    script: left out of the error tail, so its 20 lines are the user's."""
    text = line.strip()
    return text.startswith('File "') and any(f'{name}"' in text for name in LAUNCHER_FILES)


# --- readiness ----------------------------------------------------------------------------------------------
# A node gets ready to train before it registers: warm workers, and the newest checkpoint on local disk.
#
# Run beside the warm pool's imports, in a child process (`python -m petctl.elastic.prefetch`: the agent
# never imports petctl.elastic), so by the time the node's heartbeat asks the others to re-form it holds
# the code, warm workers and the checkpoint on local disk. Best effort and bounded: a failed or slow
# prefetch costs only that the first resume downloads as usual; it is reported either way.

def get_ready(spec: JobSpec, worker_spec: WorkerSpec, work_dir: Path, events: EventLog, out: IO[str],
              services: contextlib.ExitStack) -> WarmPool | None:
    """Before the node registers (its heartbeat is what makes the others re-form), get ready to train:
    the code is fetched already; prefetch the newest checkpoint and warm the workers (torch imported),
    side by side, for `WARM_WAIT` at most. Returns the warm pool (closed with `services`), if any."""
    t0 = time.monotonic()
    prefetch = Prefetch(spec.checkpoint_url, work_dir / "cache", {**os.environ, **spec.env}, events, out,
                        die_with_parent())
    prefetch.start()
    pool = (WarmPool(worker_spec, die_with_parent(), warm_spares(spec.env), fork=warm_fork(spec.env), out=out)
            if spec.warm_workers else None)
    if pool is not None and warm_yield(spec.env):
        pool.yielding = can_restore_priority()
        if not pool.yielding:
            events.emit("workers.warm_yield_unavailable",
                        reason="this agent cannot raise a priority back: the refill waits for the first step")
    if pool is not None:
        services.callback(pool.close)
        # The spares import beside the first workers where the host has a core for each, else after them.
        together = pool.spare_cores >= pool.size - worker_spec.nproc
        pool.fill(None if together else worker_spec.nproc)
        ready = pool.wait_ready(WARM_WAIT)
        report_forking(pool, events, 0)
        events.emit("workers.warm_ready", count=ready, seconds=round(time.monotonic() - t0, 3),
                    forked=pool.forking)
        refill(pool, Refill.NOW, 0, events)  # the spares, if not started yet: importing while it registers
    prefetch.finish(WARM_WAIT - (time.monotonic() - t0))
    return pool


def warm_fork(env: Mapping[str, str]) -> bool:
    """Whether the pool forks its workers from a fork server (the default); `PETCTL_WARM_FORK=0` in the job's
    environment spawns each one, importing on its own, as before."""
    return env.get("PETCTL_WARM_FORK", "").strip() != "0"


def report_forking(pool: WarmPool, events: EventLog, round_no: int) -> None:
    """One line when the pool stops forking (or never could): why, and that its workers are spawned now."""
    if pool.fork_reason and not pool.fork_reported:
        pool.fork_reported = True
        events.emit("workers.fork_server_unavailable", round=round_no, reason=pool.fork_reason,
                    fallback="warm workers are spawned, each importing on its own")


def warm_yield(env: Mapping[str, str]) -> bool:
    """Whether the job asks for the low-priority refill from the round's formation (`PETCTL_WARM_YIELD=1`).
    Opt-in: on the bench (3 nodes on 2 shared cores) it slowed the re-formed round's start (bench P1 with
    `--notice-at burst`), which a host of its own may not show; unmeasured there."""
    return env.get("PETCTL_WARM_YIELD", "").strip() == "1"


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
