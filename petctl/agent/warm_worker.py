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
import time

from petctl.agent.warmstart import after_order, await_store, host_store_early, preload, script_preloads

READY = b"petctl-warm-worker-ready\n"
# When this worker got its orders, for petctl.elastic's recovery timeline (`petctl.elastic.workerprotocol`
# reads it under the same name; a cold worker's process start time is the same moment).
ENV_ORDER_TS = "PETCTL_WORKER_ORDER_TS"


def signal_ready(fd: int) -> None:
    """Say "imports done" on the agent's own pipe, then close it.

    A channel of its own, not stdout: anything may print before this point (torch's NumPy warning, a
    sitecustomize, a `--warm-import` module), and none of it can be taken for, or hide, the signal.
    """
    try:
        os.write(fd, READY)
    finally:
        os.close(fd)


def _script_source(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):  # the script is read (and fails) when it runs; nothing to preload
        return ""


def main() -> None:
    names = [m for m in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if m]
    ready_fd = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    script = sys.argv[3] if len(sys.argv) > 3 else ""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the script will import (and fail on) what it really needs
    roots = [os.path.dirname(os.path.abspath(script)), os.getcwd(),
             *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    for name in script_preloads(_script_source(script), roots) if script else []:
        try:
            preload(name)
        except Exception:  # noqa: BLE001, S110 - any import error is the script's to raise, when it runs
            pass
    # Tell the agent we are ready (it waits for this before joining a round, see WarmPool.wait_ready).
    if ready_fd >= 0:
        signal_ready(ready_fd)
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)  # the agent discarded us unused
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    os.environ[ENV_ORDER_TS] = f"{time.time():.6f}"
    after_order(order["env"])
    try:
        store = host_store_early(order["env"])  # kept alive (referenced) while the script runs
    except Exception as e:  # noqa: BLE001 - torch starts its own server in init_process_group then
        store = None
        print(f"petctl warm worker: the rendezvous store was not started early ({e}); torch starts it",
              file=sys.stderr, flush=True)
    if store is None:
        await_store(order["env"])  # rank 0's store: connect at the first try, not after torch's backoff
    os.chdir(order["cwd"])
    argv = order["argv"]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    del store


if __name__ == "__main__":
    main()
