"""The processes of one test: every process the local provider starts (etcd, reconcilers, agents, workers)
inherits PETCTL_HOME, so "the processes of this test" are exactly those whose environment names its home."""

from __future__ import annotations

import os
import signal


def processes_with_home(prefix: str) -> list[int]:
    """Pids whose PETCTL_HOME starts with `prefix` (ours only: we set that variable ourselves)."""
    needle = f"PETCTL_HOME={prefix}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if any(item.startswith(needle) for item in env):
            pids.append(int(entry))
    return pids


def kill_processes_with_home(prefix: str) -> list[int]:
    pids = processes_with_home(prefix)
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return pids
