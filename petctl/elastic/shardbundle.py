"""One rank's shard of a sharded snapshot as one file: the in-memory snapshot header, then DCP's bytes.

    [SnapshotHeader][payload: the local tensors' bytes][meta: the pickled skeleton (`shardcodec`)]

The header is `petctl.core.snapshotrecord`'s (job, round, step, old rank, world size, lengths, checksum),
so to the agent a shard file is one more snapshot: bytes behind a header. The file is built in memory
off the training thread (`pack`: no collective, the bytes copied by torch), then written.

Never torn: a file is written to `<name>.tmp` and renamed into place (`stage`, `commit`); a reader checks
the header's own crc, the job and round (`stale_reason`) and the payload's checksum (`read_verified`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import HEADER_SIZE, SnapshotHeader, snapshot_path, stale_reason
from petctl.elastic.snapcodec import Layout, decode, payload_checksum, tensor_view

OWN, PEER = "own", "peer"


def shard_path(directory: Path | str, kind: str, local_rank: int) -> Path:
    """The newest shard file of this node's local rank `local_rank`: its own (`OWN`) or the copy it
    keeps for the previous node (`PEER`)."""
    return snapshot_path(directory, f"shard-{kind}-{local_rank}")


def pack(tensors: list[Any], layout: Layout, meta: bytes, *, job: str, round_no: int, step: int, rank: int,
         world_size: int, copied: Callable[[], None] = lambda: None) -> bytearray:
    """The shard file's bytes: header (with the payload's checksum), the tensors' bytes, the meta.
    `copied` is called once the tensors are copied (the optimizer may step from then on)."""
    return seal(fill(tensors, layout, meta, copied), job=job, round_no=round_no, step=step, rank=rank,
                world_size=world_size, data_length=layout.data_length)


def fill(tensors: list[Any], layout: Layout, meta: bytes,
         copied: Callable[[], None] = lambda: None) -> bytearray:
    """A shard file's bytes with the header blank (not a snapshot until `seal`ed)."""
    buf = bytearray(HEADER_SIZE + layout.data_length + len(meta))
    try:
        for slot, tensor in zip(layout.slots, tensors, strict=True):
            tensor_view(buf, slot, HEADER_SIZE).copy_(tensor)
    finally:
        copied()
    buf[HEADER_SIZE + layout.data_length:] = meta
    return buf


def seal(buf: bytearray, *, job: str, round_no: int, step: int, rank: int, world_size: int,
         data_length: int) -> bytearray:
    """Write the header of `fill`'s bytes, with the payload's checksum: the file is whole from here."""
    length = len(buf) - HEADER_SIZE
    header = SnapshotHeader(job=job, round=round_no, step=step, rank=rank, world_size=world_size,
                            data_length=data_length, meta_offset=data_length,
                            meta_length=length - data_length,
                            checksum=payload_checksum(buf, HEADER_SIZE, length), written_at=time.time())
    buf[:HEADER_SIZE] = header.pack()
    return buf


def unpack(buf: bytearray, weights_only: bool = True) -> Any:
    """The state a verified shard file holds (its tensors copied out). Raises ValueError,
    pickle.UnpicklingError (a skeleton `weights_only` refuses)."""
    header = SnapshotHeader.unpack(bytes(buf[:HEADER_SIZE]))
    with memoryview(buf) as view:
        payload = bytearray(view[HEADER_SIZE:])
    return decode(payload, header.data_length, header.meta_offset, header.meta_length, weights_only)


def verify(buf: bytearray | bytes, job: str, round_no: int) -> SnapshotHeader:
    """The header of a shard file's bytes, when the whole file may be loaded by a worker of `job` in
    round `round_no`. Raises WireFormatError saying why not (blank, damaged, stale, short, checksum)."""
    header = SnapshotHeader.unpack(bytes(buf[:HEADER_SIZE]))
    stale = stale_reason(header, job, round_no)
    if stale is not None:
        raise WireFormatError(f"stale: {stale}")
    if len(buf) != HEADER_SIZE + header.payload_length:
        raise WireFormatError(f"shard file is {len(buf)} bytes, its header names "
                              f"{HEADER_SIZE + header.payload_length}")
    if payload_checksum(buf, HEADER_SIZE, header.payload_length) != header.checksum:
        raise WireFormatError("checksum mismatch (the payload changed after its commit)")
    return header


def read_verified(path: Path, job: str, round_no: int) -> tuple[SnapshotHeader, bytearray]:
    """A committed shard file and its header. Raises FileNotFoundError (none), OSError, WireFormatError."""
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(buf)
    return verify(buf, job, round_no), buf


def stage(path: Path, buf: bytearray | bytes) -> Path:
    """Write `buf` beside `path` (not yet visible as a snapshot); the staged path. Raises OSError."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(buf)
    return tmp


def commit(staged: Path, path: Path) -> None:
    """Make a staged file the newest snapshot at `path` (atomic: readers see the old or the new one)."""
    os.replace(staged, path)
