"""The node's snapshot memory: a tmpfs directory the agent owns for its job, where its workers keep their
newest training state (`petctl.elastic`'s in-memory snapshot tier).

Why the agent: a worker is stopped at every re-form, and what it wrote must survive it; the agent lives as
long as the node is in the job. It creates the directory before the first round, names it in every
worker's environment (`PETCTL_SNAPSHOT_DIR`) and removes it when it exits, however the job ended (done,
killed, left, preempted): a snapshot never outlives the agent that owned it, so a later job (the same
name again) or a restarted agent never sees an earlier one. An agent killed outright (SIGKILL, OOM) cannot
clean up: the next agent started on the machine removes every directory whose owner is gone (`sweep`).

To the agent a snapshot is bytes behind a header (`petctl.core.snapshotrecord`); it never reads more.
The directory: `$PETCTL_SNAPSHOT_ROOT` (default /dev/shm, else the system temp dir) /
`petctl-snap.<job>.<node>.<agent pid>.<agent start ticks>`, mode 0700.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import SnapshotHeader
from petctl.io import procs
from petctl.io.eventlog import EventLog
from petctl.io.snapshotfiles import read_header, snapshot_files

ENV_SNAPSHOT_ROOT = "PETCTL_SNAPSHOT_ROOT"
SHM = Path("/dev/shm")
PREFIX = "petctl-snap."


def snapshot_root(environ: dict[str, str] | None = None) -> Path:
    """Where snapshot directories go: $PETCTL_SNAPSHOT_ROOT, else /dev/shm (memory), else the temp dir."""
    value = (os.environ if environ is None else environ).get(ENV_SNAPSHOT_ROOT, "")
    if value:
        return Path(value)
    return SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())


def _label(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:60]


def owner_of(path: Path) -> tuple[int, int | None] | None:
    """(pid, start ticks) of the agent that owns snapshot directory `path`; None if not one of ours."""
    if not path.name.startswith(PREFIX):
        return None
    parts = path.name.rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1]), int(parts[2]) if parts[2].isdigit() else None


def sweep(root: Path, events: EventLog | None, job: str | None = None) -> list[Path]:
    """Remove the snapshot directories under `root` whose agent is gone (killed without cleaning up),
    of job `job` only when given; reported once per sweep that removed any (`snapshot.swept`, when
    `events`)."""
    removed = []
    try:
        candidates = list(root.iterdir())
    except OSError:
        return removed
    mine = f"{PREFIX}{_label(job)}." if job is not None else PREFIX
    for path in candidates:
        owner = owner_of(path) if path.name.startswith(mine) else None
        if owner is None or procs.alive(*owner):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed and events is not None:
        events.emit("snapshot.swept", root=str(root), dirs=[p.name for p in removed])
    return removed


@dataclass
class SnapshotArea:
    """This agent's snapshot directory."""

    path: Path
    events: EventLog

    @classmethod
    def create(cls, job: str, node_id: str, events: EventLog,
               root: Path | None = None) -> SnapshotArea | None:
        """Sweep `root`, then make this agent's directory; None (reported: `snapshot.unavailable`) when it
        cannot be made: the job trains on, resuming from the store alone."""
        root = root or snapshot_root()
        sweep(root, events)
        pid = os.getpid()
        path = root / f"{PREFIX}{_label(job)}.{_label(node_id)}.{pid}.{procs.start_ticks(pid) or 0}"
        try:
            path.mkdir(mode=0o700, parents=False, exist_ok=False)
            free = shutil.disk_usage(path).free
        except OSError as e:
            events.emit("snapshot.unavailable", path=str(path), error=repr(e))
            return None
        events.emit("snapshot.area", path=str(path), free_bytes=free)
        return cls(path, events)

    def newest(self) -> SnapshotHeader | None:
        """The newest committed snapshot here (its header), if any (what a status or a test may show)."""
        headers = []
        for path in snapshot_files(self.path):
            try:
                headers.append(read_header(path))
            except (OSError, WireFormatError):
                continue
        return max(headers, key=lambda h: (h.round, h.step), default=None)

    def remove(self) -> None:
        """Delete every snapshot: the agent is leaving the job (it ended, was killed, or this node left)."""
        files = snapshot_files(self.path)
        size = sum(_size(p) for p in files)
        newest = self.newest()
        shutil.rmtree(self.path, ignore_errors=True)
        self.events.emit("snapshot.removed", path=str(self.path), files=len(files), bytes=size,
                         step=newest.step if newest else None)


def open_area(job: str, node_id: str, events: EventLog, services: contextlib.ExitStack) -> Path | None:
    """This agent's snapshot directory (`SnapshotArea.create`), removed when `services` closes: the
    workers' snapshots go with the agent, however it ends. None when it could not be made."""
    area = SnapshotArea.create(job, node_id, events)
    if area is None:
        return None
    services.callback(area.remove)
    return area.path


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
