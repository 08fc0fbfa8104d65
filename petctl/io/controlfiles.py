"""The files through which an agent and its workers talk about a save-now request or a checkpoint request
(`PETCTL_CONTROL_DIR`).

One definition shared by the agent (which never imports torch) and `petctl.elastic` (which runs inside the
workers), so the two sides cannot drift apart. The directory is local to the node:

    <control>/save_now         written by the agent on a save-now request (a spot or ASG notice, a
                               graceful leave, an admission; `Round.save_now`): {"node_id": ...,
                               "deadline": <unix ts>}: save the next step and exit
    <control>/saved.<LOCAL_RANK>  written by each worker after its save-now save: {"step": n}
    <control>/elastic.<LOCAL_RANK>  written by each worker using petctl.elastic when it starts: {"pid": n};
                               workers without it get SIGTERM at a notice instead (torchrun's way)
    <control>/fenced           written by the agent when this node may no longer belong to the running
                               round (cut off from etcd, its workers stalled): {"round": n, "reason": ...};
                               a worker never commits a checkpoint while it exists
    <control>/checkpoint       written by the agent to ask for a checkpoint now, training going on (a
                               rebalance recommendation): {"seq": n, "reason": ...}; n grows by one per
                               request
    <control>/checkpointed.<LOCAL_RANK>  written by each worker that answered request n: {"seq": n,
                               "step": s}, so a request is answered once, also by the workers of a later
                               round (both files outlive `clear`: a request is about the job's state, not
                               about one round's workers)

Files are written to a temporary name and renamed, so a reader never sees half a JSON document.
Stdlib only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from petctl.io.files import atomic_write

ENV_CONTROL_DIR = "PETCTL_CONTROL_DIR"
SAVE_NOW_FILE = "save_now"
SAVED_PREFIX = "saved."
ELASTIC_PREFIX = "elastic."
FENCE_FILE = "fenced"
CHECKPOINT_FILE = "checkpoint"
CHECKPOINTED_PREFIX = "checkpointed."


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic write: a worker polling the flag never reads a truncated document."""
    atomic_write(path, json.dumps(data))


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


def save_now_path(control_dir: Path | str) -> Path:
    return Path(control_dir) / SAVE_NOW_FILE


def saved_path(control_dir: Path | str, local_rank: int) -> Path:
    return Path(control_dir) / f"{SAVED_PREFIX}{int(local_rank)}"


def elastic_marker_path(control_dir: Path | str, local_rank: int) -> Path:
    return Path(control_dir) / f"{ELASTIC_PREFIX}{int(local_rank)}"


def mark_elastic(control_dir: Path | str, local_rank: int) -> Path:
    """Worker side, at start: this worker checkpoints on the save-now flag, so don't SIGTERM it."""
    path = elastic_marker_path(control_dir, local_rank)
    _write_json(path, {"pid": os.getpid()})
    return path


def speaks_protocol(control_dir: Path | str, local_world_size: int) -> bool:
    """Agent side: every local worker marked itself; else fall back to SIGTERM at the notice."""
    return all(elastic_marker_path(control_dir, r).exists() for r in range(local_world_size))


def write_save_now(control_dir: Path | str, node_id: str, deadline: float) -> Path:
    """Agent side: ask every local worker to checkpoint at its next step boundary and exit."""
    path = save_now_path(control_dir)
    _write_json(path, {"node_id": node_id, "deadline": float(deadline)})
    return path


def save_now_pending(control_dir: Path | str | None) -> bool:
    """Worker side, called every few steps: a stat, no parsing, so it costs next to nothing."""
    return control_dir is not None and save_now_path(control_dir).exists()


def read_save_now(control_dir: Path | str) -> dict[str, Any] | None:
    return _read_json(save_now_path(control_dir))


def write_saved(control_dir: Path | str, local_rank: int, step: int) -> Path:
    """Worker side: this rank's save-now save of `step` is complete (it exits 0 next)."""
    path = saved_path(control_dir, local_rank)
    _write_json(path, {"step": int(step)})
    return path


def read_saved(control_dir: Path | str) -> dict[int, int]:
    """Agent side: {local_rank: step} of the workers that reported their save-now save."""
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
    """Agent side: this node may have been dropped from round `round_no` (see agent/health.py); its
    workers must not commit another checkpoint. Removed by `clear` when the next round starts."""
    path = fence_path(control_dir)
    _write_json(path, {"round": int(round_no), "reason": reason})
    return path


def fenced(control_dir: Path | str | None) -> bool:
    """Worker side, just before a checkpoint is committed: a stat, so it costs next to nothing."""
    return control_dir is not None and fence_path(control_dir).exists()


def checkpoint_request_path(control_dir: Path | str) -> Path:
    return Path(control_dir) / CHECKPOINT_FILE


def checkpointed_path(control_dir: Path | str, local_rank: int) -> Path:
    return Path(control_dir) / f"{CHECKPOINTED_PREFIX}{int(local_rank)}"


def _seq(data: dict[str, Any] | None) -> int:
    value = (data or {}).get("seq")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def request_checkpoint(control_dir: Path | str, reason: str) -> int:
    """Agent side: ask this node's workers for a checkpoint at their next check step, training going on.

    Returns the request's sequence number (one more than the last request's). One writer per node (the
    agent), so the read-then-write needs no lock. Raises OSError when the control dir is unwritable.
    """
    path = checkpoint_request_path(control_dir)
    seq = _seq(_read_json(path)) + 1
    _write_json(path, {"seq": seq, "reason": str(reason)})
    return seq


def read_checkpoint_request(control_dir: Path | str | None) -> tuple[int, str]:
    """Worker side: (seq, reason) of the newest request, (0, "") when there is none (or it is unreadable)."""
    if control_dir is None:
        return 0, ""
    data = _read_json(checkpoint_request_path(control_dir))
    return _seq(data), str((data or {}).get("reason", ""))


def write_checkpointed(control_dir: Path | str, local_rank: int, seq: int, step: int) -> Path:
    """Worker side: request `seq` was answered with the checkpoint of `step`."""
    path = checkpointed_path(control_dir, local_rank)
    _write_json(path, {"seq": int(seq), "step": int(step)})
    return path


def answered_checkpoint(control_dir: Path | str | None, local_rank: int) -> int:
    """Worker side, at start: the newest request this local rank (in this round or an earlier one)
    answered; 0 when none."""
    if control_dir is None:
        return 0
    return _seq(_read_json(checkpointed_path(control_dir, local_rank)))


def clear(control_dir: Path | str, markers: bool = False) -> None:
    """Agent side, before starting a round's workers: no stale flag from an earlier round.

    `markers=True` also removes the workers' `elastic.*` markers (only while no worker runs). A
    checkpoint request and its answers stay: the next round's workers must neither miss nor repeat it.
    """
    directory = Path(control_dir)
    if not directory.is_dir():
        return
    paths = [save_now_path(directory), fence_path(directory), *directory.glob(f"{SAVED_PREFIX}*")]
    if markers:
        paths += list(directory.glob(f"{ELASTIC_PREFIX}*"))
    for path in paths:
        path.unlink(missing_ok=True)
