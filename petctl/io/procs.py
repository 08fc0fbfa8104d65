"""Processes on this machine: is a pid (still the same process and) alive, its state, a handle on one
that outlives the command that started it (`ProcRef`), its process group stopped, dying with the parent,
a free port for one to bind, and waiting (with a deadline) for one to come up or go.

Liveness and state come from `/proc/<pid>/stat` on Linux (one read, and no import of psutil, which
costs an agent about 10 ms of CPU at every start), and from psutil elsewhere. A process's identity is its
pid plus its start time in clock ticks since boot (field 22 of `/proc/<pid>/stat`): a later process
reusing the pid has another one. psutil only offers the start time in seconds since the epoch, computed
from the boot time, which moves when the system clock is stepped (NTP, a resumed VM), so a handle stored
by one command could look like a stranger to the next; the tick count never changes, and is what we
store. Linux first: elsewhere the start time is unknown (None: trust the pid alone) and
`die_with_parent` is a no-op.

A free port is one that is free right now, and "free now" is all anyone can promise: another process may
take the port between this probe and the caller's own bind, so a caller that binds later (etcd, a
worker's MASTER_PORT) must handle that race (EtcdServer.start retries on it; a round whose master port
was taken fails and re-forms).

Polling with a deadline is written once (on tenacity) instead of a `while time.monotonic() < deadline`
loop in every module. `wait_until(check, timeout, interval)` calls `check` at once, then every
`interval` seconds, until it returns something true or `timeout` has passed; an exception from `check`
propagates at once (whether a failure is worth retrying is the caller's decision). The interval is fixed,
never backed off: the callers are the agent's and the local provider's waits, where a longer poll is a
slower restart. tenacity is imported on first use, so importing this module costs nothing.

Handles that survive the CLI (`ProcRef`: a pid plus its start time): the local provider's processes
(etcd, reconcilers, agents) outlive the `petctl` command that started them, so later commands find them
again by the pid written to a file. A bare pid can be reused by an unrelated process after ours exits;
pairing it with the start time makes "is it still ours and alive?" a safe question, and signalling a
stale handle a no-op instead of hitting a stranger.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

PR_SET_PDEATHSIG = 1
GONE_STATES = ("zombie", "dead")  # exited, maybe not yet reaped: gone for every purpose of ours
STOPPED_STATES = ("stopped", "tracing-stop")  # SIGSTOP'd (a frozen local instance)


# The state letter of `/proc/<pid>/stat` (field 3, proc(5)), named as psutil names it.
PROC_STATES = {"R": "running", "S": "sleeping", "D": "disk-sleep", "T": "stopped", "t": "tracing-stop",
               "Z": "zombie", "X": "dead", "x": "dead", "K": "wake-kill", "W": "waking", "I": "idle",
               "P": "parked"}


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` from field 3 (the state) on; None when there is no such process
    (or no /proc). Raises PermissionError when the process is not ours to look at."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing ')'.
    return raw[raw.rfind(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone (or not Linux)."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return None
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


UNKNOWN = "unknown"  # the process exists, but we may not look at it (another user's)


HAS_PROC = sys.platform.startswith("linux") and os.path.isdir("/proc/self")


def _state_of(fields: list[str] | None) -> str | None:
    if fields is None:
        return None
    return PROC_STATES.get(fields[0][:1], UNKNOWN) if fields else UNKNOWN


def status(pid: int) -> str | None:
    """psutil's status of `pid` ("running", "sleeping", "stopped", "zombie", ...), `UNKNOWN` when it
    exists but is not ours to look at, None when there is no such process."""
    if HAS_PROC:
        try:
            return _state_of(_stat_fields(pid))
        except PermissionError:
            return UNKNOWN
    import psutil

    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        return UNKNOWN


def alive(pid: int, start: int | None = None) -> bool:
    """`pid` runs (or is stopped) and, when `start` is given, is the process that started then.

    A zombie counts as gone; it is never reaped here (a parent's Popen must collect the exit status).
    On Linux the state and the start time come from one read of `/proc/<pid>/stat`."""
    if HAS_PROC:
        try:
            fields = _stat_fields(pid)
        except PermissionError:
            return start is None  # it exists, but is not ours: its start time is unknown
        if _state_of(fields) in (None, *GONE_STATES):
            return False
        if start is None:
            return True
        try:
            return fields is not None and int(fields[19]) == start
        except (IndexError, ValueError):
            return False
    state = status(pid)
    if state is None or state in GONE_STATES:
        return False
    return start is None or start_ticks(pid) == start


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP): alive but not running."""
    return status(pid) in STOPPED_STATES


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get `sig` when its parent dies (PR_SET_PDEATHSIG), even by
    SIGKILL; None where the call does not exist (not Linux).

    libc is resolved here, before the fork: the child then runs no import, which matters when the parent
    has threads (a fork copies only the calling thread, an import lock held by another would deadlock)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig)

    return preexec


ANY_HOST = ""  # every interface: what a port other nodes connect to must be free on


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody is bound to on `host` (`ANY_HOST` for all interfaces). Raises OSError when
    `host` is not an address of this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, interval: float) -> T:
    """The first true value `check()` returns, else its last (false) value: that of a call that ended
    at or after `timeout` seconds (so a condition met just at the deadline is still seen). Raises what
    `check` raises."""
    from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

    retrying = Retrying(stop=stop_after_delay(max(0.0, timeout)), wait=wait_fixed(interval),
                        retry=retry_if_result(lambda value: not value),
                        retry_error_callback=lambda state: state.outcome.result())
    return retrying(check)


# --- handles that survive the CLI


@dataclass(frozen=True)
class ProcRef:
    pid: int
    start: int | None = None  # None: trust the pid alone (only for handles we just created)

    @classmethod
    def of(cls, pid: int) -> ProcRef:
        return cls(pid=pid, start=start_ticks(pid))

    def alive(self) -> bool:
        """Running or stopped, and still ours. A zombie counts as gone; it is never reaped here, because
        the reconciler's Popen must collect its children's exit status itself. No process (pid 0: an
        instance still booting) is never alive."""
        return self.pid > 0 and alive(self.pid, self.start)

    def frozen(self) -> bool:
        """Stopped (SIGSTOP: a frozen instance), and still ours."""
        return self.alive() and stopped(self.pid)

    def signal(self, sig: int) -> bool:
        """Signal the process; False if it is gone (or the pid now belongs to someone else)."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def signal_group(self, sig: int) -> bool:
        """Signal the process group led by this process (our instances run in their own session).

        Works after the leader died too, as long as any member (a worker) is left: that is how the
        provider makes sure an instance leaves no orphan behind.
        """
        if self.pid <= 0:  # no process: killpg(0) would signal the caller's own group
            return False
        now = start_ticks(self.pid)
        if self.start is not None and now is not None and now != self.start:
            return False  # the pid was reused by a new process: not our group any more
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def to_dict(self) -> dict[str, int | None]:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_dict(cls, data: dict) -> ProcRef:
        return cls(pid=int(data["pid"]), start=data.get("start"))


def wait_gone(refs: list[ProcRef], timeout: float, poll: float = 0.05) -> bool:
    """Wait until none of `refs` is alive; True if they all went within `timeout`."""
    return wait_until(lambda: not any(r.alive() for r in refs), timeout, poll)


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still there (a zombie leader with live workers counts)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(ref: ProcRef, grace: float, term_leader_only: bool = True) -> None:
    """SIGTERM (the leader, so the agent can leave gracefully), then SIGKILL the whole group."""
    ref.signal_group(signal.SIGCONT)  # a frozen instance cannot handle SIGTERM
    if term_leader_only:
        ref.signal(signal.SIGTERM)
    else:
        ref.signal_group(signal.SIGTERM)
    wait_gone([ref], grace)
    ref.signal_group(signal.SIGKILL)


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
