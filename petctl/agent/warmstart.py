"""What a warm worker does ahead of its script to shorten a restart (runs in the worker, never the agent).

- `script_preloads`: the modules the script imports that are safe to import before the worker knows its
  rank: torch's own and petctl.elastic (neither reads the environment at import). Only what the script
  imports anyway, so a script that does not use petctl.elastic pays nothing for it (measured: importing
  petctl.elastic.checkpointer after torch costs 45 ms and 0.9 MiB). The user's own modules are never
  imported early: they may read RANK or MASTER_ADDR at import.
- `host_store_early`: on global rank 0, start torch's TCPStore server the moment the order arrives. torch
  starts it inside `init_process_group` on rank 0, after the script's own start-up; a rank that connects
  before that is refused and retries with a backoff (measured: a rank 0 50 ms late made the process group
  0.3-0.4 s late). torch's env:// and tcp:// rendezvous create their store with `multi_tenant=True`, which
  shares a server already listening on that port in the same process, so the script's
  `init_process_group` adopts this one and nothing else changes (no other rank, no key, no variable).
  torchrun >= 2.4 hosts a store on MASTER_PORT too (in its agent), so a script that binds that port itself
  fails under either.
"""

from __future__ import annotations

import ast
import sys
from datetime import timedelta
from typing import Any

PRELOAD_PREFIXES = ("torch", "petctl.elastic")


def _wanted(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PRELOAD_PREFIXES)


def script_preloads(source: str) -> list[str]:
    """`module` or `module:name` for every absolute import of a PRELOAD_PREFIXES module in `source`
    (anywhere in the file: `main()`'s imports run on the critical path too). [] when it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names if _wanted(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _wanted(node.module):
            out += [f"{node.module}:{alias.name}" for alias in node.names if alias.name != "*"]
    return list(dict.fromkeys(out))


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
    dist = sys.modules.get("torch.distributed")
    if (dist is None or env.get("RANK") != "0" or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT")
            or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" or not dist.is_available()):
        return None
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env.get("WORLD_SIZE", "1")), True,
                         timedelta(minutes=30), wait_for_workers=False, multi_tenant=True)
