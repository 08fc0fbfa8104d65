"""What a node runs: the worker command shared by every node, and each worker's environment.

Pure data and functions (no processes here): `WorkerGroup` starts workers from these, `WarmPool` starts
them ahead of time. The environment is torchrun's, so a script written for torchrun runs unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from petctl.core.snapshotrecord import ENV_SNAPSHOT_DIR
from petctl.core.spec import JobSpec


def worker_base_env() -> dict[str, str]:
    """The agent's environment for a worker, with Python's fault handler on unless the user set it.

    A worker that dies in native code (SIGSEGV, or SIGABRT from `terminate called ...` at exit) then
    leaves every thread's Python stack in the node log, so the log says which thread and where, instead
    of one line and an exit code of -6.
    """
    return {"PYTHONFAULTHANDLER": "1", **os.environ}


@dataclass
class WorkerSpec:
    """What to run, identical on every node; the per-rank env is computed by `rank_env`."""

    cmd: list[str]  # [python, -u, script, *args]
    cwd: str
    nproc: int
    base_env: dict[str, str] = field(default_factory=dict)
    # Imported ahead by warm workers. torch._dynamo is what a first optimizer step pulls in (measured:
    # ~2 s on top of torch), so it belongs here too.
    preload: tuple[str, ...] = ("torch", "torch.distributed", "torch.optim", "torch._dynamo")


@dataclass(frozen=True)
class RoundPlacement:
    """Where this node's workers sit in a round: what torchrun tells each worker through its env."""

    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    run_id: str


def rank_env(spec: WorkerSpec, placement: RoundPlacement, local_rank: int,
             extra_env: dict[str, str]) -> dict[str, str]:
    """The full environment of local worker `local_rank` (torchrun's variables over the user's)."""
    nproc = spec.nproc
    world = placement.num_nodes * nproc
    rank = placement.node_rank * nproc + local_rank
    return {
        **worker_base_env(),
        **spec.base_env,
        **extra_env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(placement.node_rank),
        "GROUP_WORLD_SIZE": str(placement.num_nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "MASTER_ADDR": placement.master_addr,
        "MASTER_PORT": str(placement.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(placement.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(placement.max_restarts),
        "TORCHELASTIC_RUN_ID": placement.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "PYTHONUNBUFFERED": "1",
    }


def round_env(spec: JobSpec, node_id: str, round_no: int, control_dir: Path, work_dir: Path,
              snapshot_dir: Path | None) -> dict[str, str]:
    """What petctl adds to torchrun's environment for one round's workers (README's environment
    contract): the job, this instance, the round, the shared checkpoint location and the node's dirs."""
    snapshots = {ENV_SNAPSHOT_DIR: str(snapshot_dir)} if snapshot_dir is not None else {}
    return {"PETCTL_JOB": spec.name, "PETCTL_NODE_ID": node_id, "PETCTL_ROUND": str(round_no),
            "PETCTL_CHECKPOINT_URL": spec.checkpoint_url, "PETCTL_CONTROL_DIR": str(control_dir),
            "PETCTL_CACHE_DIR": str(work_dir / "cache"), **snapshots}
