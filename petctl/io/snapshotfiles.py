"""Reading the in-memory snapshot files a node's directory holds: their headers, and which files there are.

The header's format is a wire record (`petctl.core.snapshotrecord`); this is its I/O, shared by the agent
(which owns the directory) and `petctl.elastic` (which resumes from it).
"""

from __future__ import annotations

import os
from pathlib import Path

from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import HEADER_SIZE, SUFFIX, SnapshotHeader


def read_header(path: Path | str) -> SnapshotHeader:
    """The committed header of the snapshot file at `path`. Raises OSError when it cannot be read,
    WireFormatError when it holds no valid header or the file is shorter than the payload it names."""
    with open(path, "rb") as f:
        header = SnapshotHeader.unpack(f.read(HEADER_SIZE))
        size = os.fstat(f.fileno()).st_size
    if size < HEADER_SIZE + header.payload_length:
        raise WireFormatError(f"snapshot file truncated ({size} bytes, header names "
                              f"{HEADER_SIZE + header.payload_length})")
    return header


def snapshot_files(directory: Path | str) -> list[Path]:
    """The snapshot files in `directory` (none when it does not exist)."""
    try:
        return sorted(p for p in Path(directory).iterdir() if p.name.endswith(SUFFIX))
    except OSError:
        return []
