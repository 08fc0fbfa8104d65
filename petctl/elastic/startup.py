"""When this worker started, for the recovery timeline `Checkpointer.resume` reports (`checkpoint.resumed`).

A warm worker (the agent's warm_worker module) was started long before its round: it writes the moment it got
its orders into its environment (`PETCTL_WORKER_ORDER_TS`, the agent's side of this contract). A worker
started cold (petctl without warm workers, torchrun) has no such variable: its process start time, from
/proc, is the same moment. Stdlib only, cheap: read once per `resume`.
"""

from __future__ import annotations

import os

ENV_ORDER_TS = "PETCTL_WORKER_ORDER_TS"  # written by the agent's warm worker (a test checks both agree)


def process_start_time(pid: int | None = None) -> float | None:
    """Unix time process `pid` (default: this one) started, from /proc; None where that is unreadable."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def worker_started_at(environ: dict[str, str] | None = None) -> float | None:
    """When this worker began running the script: the warm worker's order time, else the process start."""
    value = (os.environ if environ is None else environ).get(ENV_ORDER_TS, "")
    try:
        return float(value) if value else process_start_time()
    except ValueError:
        return process_start_time()
