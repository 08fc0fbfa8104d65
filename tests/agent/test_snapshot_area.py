"""The agent's side of in-memory snapshots (no torch): its directory is made private, named after its owner,
swept when that owner is gone, and removed (with what it held) when the agent leaves."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
from pathlib import Path

from petctl.agent.snapshots import PREFIX, SnapshotArea, owner_of, snapshot_root, sweep
from petctl.core.eventlog import parse_lines
from petctl.core.snapshotrecord import HEADER_SIZE, SnapshotHeader, snapshot_path
from petctl.io import procs
from petctl.io.eventlog import EventLog


def recorder() -> tuple[EventLog, io.StringIO]:
    stream = io.StringIO()
    return EventLog("agent", stream=stream), stream


def events(stream: io.StringIO, name: str) -> list[dict]:
    return [e for e in parse_lines(stream.getvalue().splitlines()) if e["event"] == name]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_area_is_private_and_removed_with_its_snapshots(tmp_path: Path) -> None:
    log, stream = recorder()
    area = SnapshotArea.create("my job", "i-0abc", log, root=tmp_path)
    assert area is not None and area.path.parent == tmp_path
    assert stat.S_IMODE(area.path.stat().st_mode) == 0o700
    assert owner_of(area.path) == (os.getpid(), procs.start_ticks(os.getpid()))
    assert area.path.name.startswith(f"{PREFIX}my_job.i-0abc.")
    header = SnapshotHeader(job="my job", round=2, step=17, rank=0, world_size=3, data_length=0,
                            meta_offset=0, meta_length=4, checksum=0)
    snapshot_path(area.path, "state").write_bytes(header.pack() + b"meta")
    assert area.newest() == header  # the agent reads the header, never the payload
    area.remove()
    assert not area.path.exists()
    (removed,) = events(stream, "snapshot.removed")
    assert (removed["files"], removed["bytes"], removed["step"]) == (1, HEADER_SIZE + 4, 17)


def test_a_gone_agents_directory_is_swept_and_nothing_else(tmp_path: Path) -> None:
    log, stream = recorder()
    gone = tmp_path / f"{PREFIX}job.i-1.{dead_pid()}.123"
    alive = tmp_path / f"{PREFIX}job.i-2.{os.getpid()}.{procs.start_ticks(os.getpid())}"
    reused = tmp_path / f"{PREFIX}job.i-3.{os.getpid()}.1"  # our pid, but another process's start time
    other = tmp_path / "someone-elses"
    for path in (gone, alive, reused, other):
        path.mkdir()
        (path / "state.snap").write_bytes(b"x")
    assert sorted(sweep(tmp_path, log)) == sorted([gone, reused])
    assert alive.exists() and other.exists() and not gone.exists() and not reused.exists()
    assert sorted(events(stream, "snapshot.swept")[0]["dirs"]) == sorted([gone.name, reused.name])
    # A new agent sweeps before it makes its own directory.
    (tmp_path / gone.name).mkdir()
    area = SnapshotArea.create("job", "i-4", log, root=tmp_path)
    assert area is not None and not gone.exists()


def test_no_area_when_the_root_is_unusable(tmp_path: Path) -> None:
    log, stream = recorder()
    missing = tmp_path / "no" / "such" / "root"
    assert SnapshotArea.create("job", "i-1", log, root=missing) is None
    assert events(stream, "snapshot.unavailable")


def test_the_root_is_memory_unless_told_otherwise(tmp_path: Path) -> None:
    assert snapshot_root({"PETCTL_SNAPSHOT_ROOT": str(tmp_path)}) == tmp_path
    default = snapshot_root({})
    assert default == Path("/dev/shm") or not Path("/dev/shm").is_dir()


def test_kill_job_sweeps_its_own_gone_agents_directories_only(tmp_path: Path) -> None:
    """The local provider's kill_job sweeps job by job: a local "instance" ended by a reclaim leaves its
    /dev/shm directory behind (an EC2 instance's memory goes with it); another job's is not its to remove."""
    mine = tmp_path / f"{PREFIX}soak.i-1.{dead_pid()}.123"
    prefixed = tmp_path / f"{PREFIX}soak_2.i-1.{dead_pid()}.123"  # another job whose name starts the same
    theirs = tmp_path / f"{PREFIX}other.i-1.{dead_pid()}.123"
    for path in (mine, prefixed, theirs):
        path.mkdir()
    assert sweep(tmp_path, None, job="soak") == [mine]
    assert prefixed.exists() and theirs.exists()
