"""How many nodes this round has, for frameworks that must be told (Lightning's `num_nodes`).

petctl changes the world size between rounds (a node lost, one added), and starts every round's workers
with torchrun's environment: `WORLD_SIZE` (all workers) and `LOCAL_WORLD_SIZE` (workers on this node).
A script that hard-codes `num_nodes=2` works until the world shrinks, then fails in every worker:
Lightning checks `devices * num_nodes == WORLD_SIZE`. Stdlib only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def devices_per_node(environ: Mapping[str, str] | None = None) -> int:
    """Workers on this node (`LOCAL_WORLD_SIZE`, petctl's `--nproc-per-node`; 1 outside torchrun): the
    Trainer's `devices`. Raises ValueError, in one line, when the variable is not a positive integer."""
    value = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {value!r}")
    return int(value)


def num_nodes(devices: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """This round's node count: WORLD_SIZE / devices per node (default LOCAL_WORLD_SIZE, else 1).

    Raises ValueError, in one line, when the environment is malformed or the world size is not a
    multiple of `devices` (the Trainer's `devices` must be the agent's `--nproc-per-node`)."""
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        per_node = int(devices if devices is not None else env.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"WORLD_SIZE/LOCAL_WORLD_SIZE must be integers: {e}") from None
    if per_node < 1 or world < 1 or world % per_node:
        raise ValueError(f"world size {world} is not a whole number of nodes of {per_node} device(s) each: "
                         "the Trainer's devices must equal petctl's --nproc-per-node")
    return world // per_node
