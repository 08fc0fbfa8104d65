"""The in-memory snapshot's wire format: a fixed header in front of opaque bytes, shared by the agent
(which owns the memory and never imports torch) and `petctl.elastic` (which writes and reads the bytes).

A node keeps its newest training state in a file under a tmpfs directory the agent creates for its job
(`$PETCTL_SNAPSHOT_DIR`), so the snapshot outlives the worker that wrote it: a re-form can restart from
it instead of from the last periodic checkpoint. One file per writer (`<name>.snap`), laid out as

    [header: HEADER_SIZE bytes][payload: data, then meta]    (offsets relative to the payload)

To the agent a snapshot is that header and `payload_length` bytes. What the payload means (tensor bytes,
the state's skeleton in `meta`) is `petctl.elastic.snapshots.codec`'s business.

Why a torn or stale snapshot is never loaded:
- The writer zeroes the header before it touches the payload and writes the header last, with the
  payload's checksum (`petctl.elastic.snapshots.codec.payload_checksum`: opaque to the agent, which never
  reads the payload) and a crc32 of the header itself: a writer killed mid-copy leaves no header, one killed
  mid-header leaves a header whose own crc fails, and a payload changed after the commit fails its crc.
- The header names the job and the round that wrote it: a reader in round R accepts only a snapshot of
  its own job written in an earlier round (`stale_reason`).
Stdlib only.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from petctl.core.records import WireFormatError

ENV_SNAPSHOT_DIR = "PETCTL_SNAPSHOT_DIR"  # the node's snapshot directory, set by the agent for its workers
MAGIC = b"PETSNAP\x00"
VERSION = 1
HEADER_SIZE = 4096  # the payload starts page-aligned, so tensor views into it can be aligned too
SUFFIX = ".snap"
JOB_BYTES = 128  # the job's name, utf-8, NUL-padded (job names are short DNS-like labels)
# magic, version, step, round, rank, world, payload length, data length, meta offset, meta length,
# payload crc32, written at (unix s), job
_BODY = struct.Struct(f"<8sIqqiiQQQQIxxxxd{JOB_BYTES}s")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class SnapshotHeader:
    """What a committed snapshot says about itself."""

    job: str
    round: int  # the round whose worker wrote it ($PETCTL_ROUND)
    step: int  # the step whose completed state it holds (resume runs step + 1)
    rank: int  # the writer's global rank then
    world_size: int
    data_length: int  # bytes of tensor data at the start of the payload
    meta_offset: int  # where the meta bytes start, from the payload's start
    meta_length: int
    checksum: int  # of the whole payload (petctl.elastic.snapshots.codec.payload_checksum)
    written_at: float = 0.0
    version: int = VERSION

    @property
    def payload_length(self) -> int:
        return self.meta_offset + self.meta_length

    def pack(self) -> bytes:
        """The header's bytes (HEADER_SIZE, zero-padded), ending in a crc32 of what precedes it."""
        job = self.job.encode("utf-8")
        if len(job) > JOB_BYTES:
            raise ValueError(f"job name longer than {JOB_BYTES} bytes: {self.job!r}")
        body = _BODY.pack(MAGIC, self.version, self.step, self.round, self.rank, self.world_size,
                          self.payload_length, self.data_length, self.meta_offset, self.meta_length,
                          self.checksum, self.written_at, job)
        return (body + _CRC.pack(zlib.crc32(body))).ljust(HEADER_SIZE, b"\x00")

    @classmethod
    def unpack(cls, data: bytes) -> SnapshotHeader:
        """Parse a header. Raises WireFormatError when it is blank (a write in progress or never
        committed), of another format or version, or damaged (its own crc fails)."""
        if len(data) < _BODY.size + _CRC.size:
            raise WireFormatError(f"snapshot header too short ({len(data)} bytes)")
        body = bytes(data[:_BODY.size])
        if body[:len(MAGIC)] != MAGIC:
            raise WireFormatError("no committed snapshot (blank header: never written, or cut off mid-write)")
        (crc,) = _CRC.unpack_from(data, _BODY.size)
        if zlib.crc32(body) != crc:
            raise WireFormatError("snapshot header damaged (its crc32 does not match)")
        (_magic, version, step, rnd, rank, world, payload, data_len, meta_off, meta_len, checksum, written,
         job) = _BODY.unpack(body)
        if version != VERSION:
            raise WireFormatError(f"snapshot format version {version}, this reader knows {VERSION}")
        header = cls(job=job.rstrip(b"\x00").decode("utf-8", "replace"), round=rnd, step=step, rank=rank,
                     world_size=world, data_length=data_len, meta_offset=meta_off, meta_length=meta_len,
                     checksum=checksum, written_at=written, version=version)
        if header.payload_length != payload or data_len > meta_off or step < 0:
            raise WireFormatError("snapshot header inconsistent (lengths or step)")
        return header


BLANK = bytes(HEADER_SIZE)  # what the writer puts in the header slot before it touches the payload


def stale_reason(header: SnapshotHeader, job: str, current_round: int) -> str | None:
    """Why `header` must not be loaded by a worker of `job` in round `current_round`; None if it may.

    A snapshot is the state some earlier round of this job reached. One from another job (a name reused
    later on this node) or from this round or a later one (not written by a predecessor of this worker)
    is never this job's history."""
    if header.job != job:
        return f"written by job {header.job!r}, not {job!r}"
    if header.round >= current_round:
        return f"written in round {header.round}, not before the current round {current_round}"
    return None


def snapshot_path(directory: Path | str, name: str) -> Path:
    return Path(directory) / f"{name}{SUFFIX}"
