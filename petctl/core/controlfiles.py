"""The files through which an agent and its workers talk about a preemption (`PETCTL_CONTROL_DIR`).

One definition shared by the agent (which never imports torch) and `petctl.elastic` (which runs inside the
workers), so the two sides cannot drift apart. The directory is local to the node:

    <control>/preempt          written by the agent: {"node_id": ..., "deadline": <unix ts>}
    <control>/saved.<LOCAL_RANK>  written by each worker after its preemption save: {"step": n}
    <control>/elastic.<LOCAL_RANK>  written by each worker using petctl.elastic when it starts: {"pid": n};
                               workers without it get SIGTERM at a notice instead (torchrun's way)
    <control>/fenced           written by the agent when this node may no longer belong to the running
                               round (cut off from etcd, its workers stalled): {"round": n, "reason": ...};
                               a worker never commits a checkpoint while it exists

Files are written to a temporary name and renamed, so a reader never sees half a JSON document.
Stdlib only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

ENV_CONTROL_DIR = "PETCTL_CONTROL_DIR"
PREEMPT_FILE = "preempt"
SAVED_PREFIX = "saved."
ELASTIC_PREFIX = "elastic."
FENCE_FILE = "fenced"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic write: a worker polling the flag never reads a truncated document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def control_dir_from_env(environ: dict[str, str] | None = None) -> Path | None:
    """The worker's control dir, or None when it does not run under a petctl agent."""
    value = (environ if environ is not None else os.environ).get(ENV_CONTROL_DIR, "")
    return Path(value) if value else None


def preempt_path(control_dir: Path | str) -> Path:
    return Path(control_dir) / PREEMPT_FILE


def saved_path(control_dir: Path | str, local_rank: int) -> Path:
    return Path(control_dir) / f"{SAVED_PREFIX}{int(local_rank)}"


def elastic_marker_path(control_dir: Path | str, local_rank: int) -> Path:
    return Path(control_dir) / f"{ELASTIC_PREFIX}{int(local_rank)}"


def mark_elastic(control_dir: Path | str, local_rank: int) -> Path:
    """Worker side, at start: this worker checkpoints on the preempt flag, so don't SIGTERM it."""
    path = elastic_marker_path(control_dir, local_rank)
    _write_json(path, {"pid": os.getpid()})
    return path


def speaks_protocol(control_dir: Path | str, local_world_size: int) -> bool:
    """Agent side: every local worker marked itself; else fall back to SIGTERM at the notice."""
    return all(elastic_marker_path(control_dir, r).exists() for r in range(local_world_size))


def write_preempt(control_dir: Path | str, node_id: str, deadline: float) -> Path:
    """Agent side: ask every local worker to checkpoint at its next step boundary and exit."""
    path = preempt_path(control_dir)
    _write_json(path, {"node_id": node_id, "deadline": float(deadline)})
    return path


def preempt_pending(control_dir: Path | str | None) -> bool:
    """Worker side, called every few steps: a stat, no parsing, so it costs next to nothing."""
    return control_dir is not None and preempt_path(control_dir).exists()


def read_preempt(control_dir: Path | str) -> dict[str, Any] | None:
    return _read_json(preempt_path(control_dir))


def write_saved(control_dir: Path | str, local_rank: int, step: int) -> Path:
    """Worker side: this rank's preemption save of `step` is complete (it exits 0 next)."""
    path = saved_path(control_dir, local_rank)
    _write_json(path, {"step": int(step)})
    return path


def read_saved(control_dir: Path | str) -> dict[int, int]:
    """Agent side: {local_rank: step} of the workers that reported their preemption save."""
    out: dict[int, int] = {}
    directory = Path(control_dir)
    if not directory.is_dir():
        return out
    for path in directory.glob(f"{SAVED_PREFIX}*"):
        suffix = path.name[len(SAVED_PREFIX):]
        data = _read_json(path)
        if suffix.isdigit() and data is not None and isinstance(data.get("step"), int):
            out[int(suffix)] = data["step"]
    return out


def all_saved(control_dir: Path | str, local_world_size: int) -> bool:
    saved = read_saved(control_dir)
    return all(rank in saved for rank in range(local_world_size))


def fence_path(control_dir: Path | str) -> Path:
    return Path(control_dir) / FENCE_FILE


def write_fence(control_dir: Path | str, round_no: int, reason: str) -> Path:
    """Agent side: this node may have been dropped from round `round_no` (see agent/fencing.py); its
    workers must not commit another checkpoint. Removed by `clear` when the next round starts."""
    path = fence_path(control_dir)
    _write_json(path, {"round": int(round_no), "reason": reason})
    return path


def fenced(control_dir: Path | str | None) -> bool:
    """Worker side, just before a checkpoint is committed: a stat, so it costs next to nothing."""
    return control_dir is not None and fence_path(control_dir).exists()


def clear(control_dir: Path | str, markers: bool = False) -> None:
    """Agent side, before starting a round's workers: no stale flag from an earlier round.

    `markers=True` also removes the workers' `elastic.*` markers (only while no worker runs).
    """
    directory = Path(control_dir)
    if not directory.is_dir():
        return
    paths = [preempt_path(directory), fence_path(directory), *directory.glob(f"{SAVED_PREFIX}*")]
    if markers:
        paths += list(directory.glob(f"{ELASTIC_PREFIX}*"))
    for path in paths:
        path.unlink(missing_ok=True)
