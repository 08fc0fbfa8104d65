"""What a warm worker does ahead of its script to shorten a restart (runs in the worker, never the agent).

- `script_preloads`: the modules the script imports that are safe to import before the worker knows its
  rank: torch's own, petctl.elastic, and the training frameworks (transformers with accelerate, Lightning:
  seconds of imports each, the largest part of a framework job's restart). Only what the script imports
  anyway, so a script that does not use them pays nothing (measured: importing
  petctl.elastic.checkpointer after torch costs 45 ms and 0.9 MiB). The user's own modules are never
  imported early (they may read RANK or MASTER_ADDR at import), but they are read: the imports of a
  module of the script's own tree (`from examples.hf_trainer import main`) count as the script's.
- `after_order`: what a preloaded module read from the environment at import and must read again now
  (Lightning's rank-zero guard takes RANK at import: a warm worker had none, so every rank printed as 0
  until the Trainer's strategy set it).
- `host_store_early`: on global rank 0, start torch's TCPStore server the moment the order arrives. torch
  starts it inside `init_process_group` on rank 0, after the script's own start-up; a rank that connects
  before that is refused and retries with a backoff (measured: a rank 0 50 ms late made the process group
  0.3-0.4 s late). torch's env:// and tcp:// rendezvous create their store with `multi_tenant=True`, which
  shares a server already listening on that port in the same process, so the script's
  `init_process_group` adopts this one and nothing else changes (no other rank, no key, no variable).
  torchrun >= 2.4 hosts a store on MASTER_PORT too (in its agent), so a script that binds that port itself
  fails under either.
- `await_store`: on every other rank, wait until that store accepts connections before the script runs.
  Rank 0's order may arrive after ours (its node is still stopping its old workers), and torch's client,
  refused, backs off: measured, a client 30 ms early connected 0.54 s after the server was up (bench P3,
  4 ranks: the process group took 0.6 s instead of 0.01). A bare TCP connect, closed at once, is all it
  takes; the server ignores it.
"""

from __future__ import annotations

import ast
import os
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

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
