"""Process handles that survive the CLI: a pid plus its kernel start time.

The local provider's processes (etcd, reconcilers, agents) outlive the `petctl` command that started
them, so later commands find them again by the pid written to a file. A bare pid can be reused by an
unrelated process after ours exits; pairing it with the start time (`petctl.io.procs.start_ticks`) makes
"is it still ours and alive?" a safe question, and signalling a stale handle a no-op instead of hitting a
stranger. Liveness and state come from `petctl.io.procs` (psutil).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from petctl.io import procs
from petctl.io.procs import start_ticks, wait_until

__all__ = ["ProcRef", "group_alive", "start_ticks", "stop_group", "wait_gone"]


@dataclass(frozen=True)
class ProcRef:
    pid: int
    start: int | None = None  # None: trust the pid alone (only for handles we just created)

    @classmethod
    def of(cls, pid: int) -> ProcRef:
        return cls(pid=pid, start=start_ticks(pid))

    def alive(self) -> bool:
        """Running or stopped, and still ours. A zombie counts as gone; it is never reaped here, because
        the reconciler's Popen must collect its children's exit status itself."""
        return procs.alive(self.pid, self.start)

    def frozen(self) -> bool:
        """Stopped (SIGSTOP: a frozen instance), and still ours."""
        return self.alive() and procs.stopped(self.pid)

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
