"""A worker process started before it is needed, with the heavy imports (torch) already done.

Why: on a restart the slowest phase is not the rendezvous (tens of ms) but a fresh Python importing
torch (seconds). The agent keeps `nproc` of these waiting; when a round forms it sends each one its
environment and command line on stdin, and it runs the user's script exactly as `python script.py`
would (`runpy.run_path` as `__main__`, script dir first on sys.path). Only what the script reads at run
time differs per round (RANK, WORLD_SIZE, MASTER_ADDR, ...); torch reads those when the process group is
initialised, not at import. This module runs in the worker, never in the agent.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

READY = b"petctl-warm-worker-ready\n"


def signal_ready(fd: int) -> None:
    """Say "imports done" on the agent's own pipe, then close it.

    A channel of its own, not stdout: anything may print before this point (torch's NumPy warning, a
    sitecustomize, a `--warm-import` module), and none of it can be taken for, or hide, the signal.
    """
    try:
        os.write(fd, READY)
    finally:
        os.close(fd)


def main() -> None:
    preload = [m for m in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if m]
    ready_fd = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the script will import (and fail on) what it really needs
    # Tell the agent we are ready (it waits for this before joining a round, see WarmPool.wait_ready).
    if ready_fd >= 0:
        signal_ready(ready_fd)
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)  # the agent discarded us unused
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    argv = order["argv"]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
