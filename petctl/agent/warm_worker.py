"""A warm worker: the process the warm pool (workers.py) starts ahead of a round. It runs in the worker, never
in the agent (`python -m petctl.agent.warm_worker`).

Sections: what it does ahead of its script (warm start); the process itself (this docstring).

A worker process started before it is needed, with the heavy imports (torch) already done.

Why: on a restart the slowest phase is not the rendezvous (tens of ms) but a fresh Python importing
torch (seconds). The agent keeps `nproc` of these waiting; when a round forms it sends each one its
environment and command line on stdin, and it runs the user's script exactly as `python script.py`
would (`runpy.run_path` as `__main__`, script dir first on sys.path). Only what the script reads at run
time differs per round (RANK, WORLD_SIZE, MASTER_ADDR, ...); torch reads those when the process group is
initialised, not at import. This module runs in the worker, never in the agent.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import importlib
import json
import os
import runpy
import socket
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

# --- warm start ---------------------------------------------------------------------------------------------
# What a warm worker does ahead of its script to shorten a restart (runs in the worker, never the agent).
#
# - `script_preloads`: the modules the script imports that are safe to import before the worker knows its
#   rank: torch's own, petctl.elastic, and the training frameworks (transformers with accelerate, Lightning:
#   seconds of imports each, the largest part of a framework job's restart). Only what the script imports
#   anyway, so a script that does not use them pays nothing (measured: importing
#   petctl.elastic.checkpointer after torch costs 45 ms and 0.9 MiB). The user's own modules are never
#   imported early (they may read RANK or MASTER_ADDR at import), but they are read: the imports of a
#   module of the script's own tree (`from examples.hf_trainer import main`) count as the script's.
# - `after_order`: what a preloaded module read from the environment at import and must read again now
#   (Lightning's rank-zero guard takes RANK at import: a warm worker had none, so every rank printed as 0
#   until the Trainer's strategy set it).
# - `host_store_early`: on global rank 0, start torch's TCPStore server the moment the order arrives. torch
#   starts it inside `init_process_group` on rank 0, after the script's own start-up; a rank that connects
#   before that is refused and retries with a backoff (measured: a rank 0 50 ms late made the process group
#   0.3-0.4 s late). torch's env:// and tcp:// rendezvous create their store with `multi_tenant=True`, which
#   shares a server already listening on that port in the same process, so the script's
#   `init_process_group` adopts this one and nothing else changes (no other rank, no key, no variable).
#   torchrun >= 2.4 hosts a store on MASTER_PORT too (in its agent), so a script that binds that port itself
#   fails under either.
# - `await_store`: on every other rank, wait until that store accepts connections before the script runs.
#   Rank 0's order may arrive after ours (its node is still stopping its old workers), and torch's client,
#   refused, backs off: measured, a client 30 ms early connected 0.54 s after the server was up (bench P3,
#   4 ranks: the process group took 0.6 s instead of 0.01). A bare TCP connect, closed at once, is all it
#   takes; the server ignores it.

PRELOAD_PREFIXES = ("torch", "petctl.elastic", "transformers", "accelerate", "lightning", "pytorch_lightning",
                    "lightning_fabric")
FOLLOW_FILES = 16  # at most this many of the script's own modules are read for their imports
STORE_WAIT = 3.0  # at most: then torch's own connect, with its backoff, takes over
STORE_POLL = 0.005


def _wanted(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PRELOAD_PREFIXES)


def script_preloads(source: str, roots: Sequence[str] = ()) -> list[str]:
    """`module` or `module:name` for every absolute import of a PRELOAD_PREFIXES module in `source`
    (anywhere in the file: `main()`'s imports run on the critical path too), and in the modules of the
    script's own that it imports and that are files under `roots` (its directory, the working
    directory, PYTHONPATH), read, never imported, breadth first up to FOLLOW_FILES files. [] when the
    script does not parse."""
    out: list[str] = []
    queue: list[str] = [source]
    seen: set[str] = set()  # the script's own modules read so far
    while queue:
        text = queue.pop(0)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            if text is source:
                return []
            continue
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
                out += [n for n in names if _wanted(n)]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if _wanted(node.module):
                    out += [f"{node.module}:{alias.name}" for alias in node.names if alias.name != "*"]
                names = [node.module]
            for name in names:
                found = None if _wanted(name) else _own_module(name, roots)
                if found is not None and found not in seen and len(seen) < FOLLOW_FILES:
                    seen.add(found)
                    queue.append(_read(found))
    return list(dict.fromkeys(out))


def _own_module(name: str, roots: Sequence[str]) -> str | None:
    """The file of module `name` under one of `roots` (a module of the script's own tree), or None."""
    rel = name.replace(".", os.sep)
    for root in roots:
        for path in (os.path.join(root, rel + ".py"), os.path.join(root, rel, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def after_order(env: dict[str, str]) -> None:
    """Give a preloaded module what it took from the environment at import (see the module)."""
    guard = sys.modules.get("lightning_utilities.core.rank_zero")
    if guard is not None and env.get("RANK", "").isdigit():
        guard.rank_zero_only.rank = int(env["RANK"])  # type: ignore[attr-defined]


def preload(name: str) -> None:
    """Import `module` (and `getattr` the name of `module:name`, which loads a lazily exported one).
    Raises what the import raises."""
    import importlib

    module, _, attr = name.partition(":")
    mod = importlib.import_module(module)
    if attr and not hasattr(mod, attr):
        importlib.import_module(f"{module}.{attr}")  # `from torch import nn`: a submodule


def host_store_early(env: dict[str, str]) -> Any:
    """The TCPStore server for this round, started now, on global rank 0 only; None elsewhere, when torch
    is not preloaded (no import on the critical path) or when the script's environment asks for an agent
    store. Raises what TCPStore raises (the port taken, say): the caller reports it and goes on."""
    address = _store_address(env)
    dist = sys.modules.get("torch.distributed")
    if address is None or dist is None or env.get("RANK") != "0" or not dist.is_available():
        return None
    return dist.TCPStore(address[0], address[1], int(env.get("WORLD_SIZE", "1")), True,
                         timedelta(minutes=30), wait_for_workers=False, multi_tenant=True)


def _store_address(env: dict[str, str]) -> tuple[str, int] | None:
    """Where this round's store listens, when the script is a torch.distributed one that torch's env://
    rendezvous will connect to: MASTER_ADDR/PORT set, no agent store, torch.distributed preloaded."""
    dist = sys.modules.get("torch.distributed")
    if (dist is None or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT", "").isdigit()
            or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"):
        return None
    return env["MASTER_ADDR"], int(env["MASTER_PORT"])


def await_store(env: dict[str, str], timeout: float = STORE_WAIT) -> float | None:
    """On a rank other than 0: wait (bounded) until rank 0's store accepts a connection; the seconds
    waited, or None when it does not apply or the store was not up in time (torch then retries itself).
    Never raises."""
    address = _store_address(env)
    if address is None or env.get("RANK") == "0":
        return None
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            socket.create_connection(address, timeout=0.2).close()
            return time.monotonic() - t0
        except OSError:
            time.sleep(STORE_POLL)
    return None


# --- the warm worker process --------------------------------------------------------------------------------

READY = b"petctl-warm-worker-ready\n"
ENV_WARM_NICE = "PETCTL_WARM_NICE"  # on a refill's workers: the node's nice value, theirs again at the order
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


class OrderReader:
    """Reads the order (one line on stdin) in a thread of its own, so that it arrives while the imports still
    run: a refill worker imports at a lower CPU priority (`ENV_WARM_NICE`, workers.py's `refill_due`) and
    gets the node's back the moment it is handed out, not once its imports are done (the round waits for
    those)."""

    def __init__(self, base_nice: int | None) -> None:
        self.base_nice = base_nice
        self.line = ""
        self.done = threading.Event()
        threading.Thread(target=self._read, name="warm-order", daemon=True).start()

    def _read(self) -> None:
        try:
            self.line = sys.stdin.readline()
            if self.line and self.base_nice is not None and not raise_priority("self", self.base_nice):
                print(f"petctl warm worker: CPU priority not raised back to nice {self.base_nice} after the "
                      "warm-up; the script runs at the warm-up's", file=sys.stderr, flush=True)
        finally:
            self.done.set()

    def wait(self) -> str:
        self.done.wait()
        return self.line


def raise_priority(pid: int | str, nice: int) -> bool:
    """Bring every thread of process `pid` ("self": this one) that runs at a higher nice value down to `nice`
    (Linux nice values are per thread; the threads an import started inherited the warm-up's). False if
    refused or not on Linux (nothing changed then, or only some threads). Never raises."""
    try:
        for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
            if os.getpriority(os.PRIO_PROCESS, tid) > nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
    except ProcessLookupError:
        return True  # it exited (or a thread did): nothing left to raise
    except (OSError, ValueError):
        return False
    return True


def _script_source(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):  # the script is read (and fails) when it runs; nothing to preload
        return ""


def warm_up(names: Sequence[str], script: str) -> None:
    """The imports ahead of the script: `names` (the worker spec's preload), then what the script imports
    (`script_preloads`). An import that fails is skipped: the script raises it when it runs."""
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


def run_order(orders: OrderReader) -> None:
    """Wait for the order, then run the script in this process as `python script.py` would; returns at once
    (the process then exits 0) when the agent closes our stdin without one (it discarded us unused)."""
    line = orders.wait()
    if not line:
        return
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
    try:
        namespace = runpy.run_path(argv[0], run_name="__main__")  # the script's objects: freed below
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
        finish_script()
        raise
    finish_script()
    del namespace, store  # where a gloo group's destructor may deadlock (see finish_script)


# The line a worker prints once its script has finished and only the interpreter's exit is left.
EXITING = "worker.exiting"


def finish_script() -> None:
    """Do what the interpreter does at exit before it frees anything (wait for the script's non-daemon
    threads, run its atexit handlers, flush), then tell the agent the script is done: one `worker.exiting`
    event on stdout.

    Why: freeing the script's objects can hang for good. Measured here under load (torch 2.13, gloo): the
    main thread, holding the GIL, destroys DDP's Reducer and with it the ProcessGroupGloo, whose destructor
    joins its work thread, and that thread waits for the GIL to drop a Python object of its last work
    (pytorch/pytorch#56297, the same family). The agent then stopped the worker only after finish_grace
    (60 s) and the job ended a minute late. With this line it knows the script finished: a worker still
    alive exit_grace (10 s) after it is stuck at exit, and is stopped (agent/roundjudge.py). Everything the
    script asked to happen at exit has happened by then; what is left is the freeing itself."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the interpreter runs them here too, then none are left
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # the script may have closed or replaced it
            stream.flush()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    line = json.dumps({"ts": time.time(), "event": EXITING, "local_rank": rank})
    with contextlib.suppress(OSError):
        os.write(1, (line + "\n").encode())


def main() -> None:
    names = [m for m in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if m]
    ready_fd = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    script = sys.argv[3] if len(sys.argv) > 3 else ""
    base = os.environ.get(ENV_WARM_NICE, "")
    orders = OrderReader(int(base) if base.lstrip("-").isdigit() else None)
    warm_up(names, script)
    # Tell the agent we are ready (it waits for this before joining a round, see WarmPool.wait_ready).
    if ready_fd >= 0:
        signal_ready(ready_fd)
    run_order(orders)


if __name__ == "__main__":
    main()
