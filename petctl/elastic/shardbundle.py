"""One rank's shard of a sharded snapshot as one file: the in-memory snapshot header, then DCP's bytes.

    [SnapshotHeader][payload: the rank's DCP data file][the rank's own DCP metadata (pickled)]

The header is `petctl.core.snapshotrecord`'s (job, round, step, old rank, world size, lengths, checksum),
so to the agent a shard file is one more snapshot: bytes behind a header. Why DCP with `no_dist`: the
capture runs on a background thread while the next step computes, so it must not run a collective (the
training thread owns the default group); without coordination each rank writes its chunks and a
metadata of its own chunks only (no plan exchange at all, so no plan caching to do either). A resume
puts the W files of one save side by side, merges their metadata (`restore_dir`) and `dcp.load`s them,
which reshards to any new world size as a store checkpoint does.

Never torn: a file is written to `<name>.tmp` and renamed into place (`stage`, `commit`); a reader checks
the header's own crc, the job and round (`stale_reason`) and the payload's checksum (`read_verified`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import HEADER_SIZE, SnapshotHeader, snapshot_path, stale_reason
from petctl.elastic.snapcodec import payload_checksum

DATA_FILE = "__0_0.distcp"  # what DCP writes without coordination, with one writer thread
METADATA_FILE = ".metadata"
OWN, PEER = "own", "peer"


def shard_path(directory: Path | str, kind: str, local_rank: int) -> Path:
    """The newest shard file of this node's local rank `local_rank`: its own (`OWN`) or the copy it
    keeps for the previous node (`PEER`)."""
    return snapshot_path(directory, f"shard-{kind}-{local_rank}")


def capture(state_dict: dict[str, Any], workdir: Path) -> tuple[bytes, bytes]:
    """(data, metadata) of `state_dict` as DCP writes them for this rank alone. No collective; raises
    what DCP raises (OSError: the tmpfs is full; RuntimeError, ValueError: an unsupported state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    shutil.rmtree(workdir, ignore_errors=True)
    try:
        dcp.save(state_dict, storage_writer=FileSystemWriter(workdir, sync_files=False, thread_count=1),
                 no_dist=True)
        files = {p.name for p in workdir.iterdir()}
        if files - {DATA_FILE, METADATA_FILE}:
            raise RuntimeError(f"unexpected DCP files {sorted(files)}")
        data = (workdir / DATA_FILE).read_bytes() if DATA_FILE in files else b""
        return data, (workdir / METADATA_FILE).read_bytes()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def pack(data: bytes, meta: bytes, *, job: str, round_no: int, step: int, rank: int,
         world_size: int) -> bytearray:
    """The shard file's bytes: header (with the payload's checksum), data, metadata."""
    buf = bytearray(HEADER_SIZE + len(data) + len(meta))
    buf[HEADER_SIZE:HEADER_SIZE + len(data)] = data
    buf[HEADER_SIZE + len(data):] = meta
    header = SnapshotHeader(job=job, round=round_no, step=step, rank=rank, world_size=world_size,
                            data_length=len(data), meta_offset=len(data), meta_length=len(meta),
                            checksum=payload_checksum(buf, HEADER_SIZE, len(data) + len(meta)),
                            written_at=time.time())
    buf[:HEADER_SIZE] = header.pack()
    return buf


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


def restore_dir(target: Path, shards: dict[int, bytearray]) -> Path:
    """A DCP checkpoint directory holding the shards of every old rank (`shards`: old rank -> verified
    shard file bytes) and their metadata merged: what `dcp.load` reads, resharding as it goes. Raises
    OSError, pickle errors on a metadata DCP cannot read."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    metas = {}
    for old_rank, buf in sorted(shards.items()):
        header = SnapshotHeader.unpack(bytes(buf[:HEADER_SIZE]))
        start = HEADER_SIZE + header.meta_offset
        with memoryview(buf) as view:
            (target / _data_name(old_rank)).write_bytes(view[HEADER_SIZE:HEADER_SIZE + header.data_length])
            metas[old_rank] = pickle.loads(view[start:start + header.meta_length])  # noqa: S301 - our own verified file
    with open(target / METADATA_FILE, "wb") as f:
        pickle.dump(merge_metadata(metas), f)
    return target


def _data_name(old_rank: int) -> str:
    return f"__{old_rank}_0.distcp"


def merge_metadata(metas: dict[int, Any]) -> Any:
    """One DCP `Metadata` for the shards of several ranks, each saved alone: every rank's chunks of each
    tensor (a chunk saved by several ranks, a replicated tensor, once), each rank's storage entries
    pointing at its own data file, the first rank's entry for an item several saved (a replicated
    value: the same bytes)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    for old_rank, md in sorted(metas.items()):
        merged.version = merged.version or md.version
        for fqn, item in md.state_dict_metadata.items():
            have = merged.state_dict_metadata.get(fqn)
            if have is None:
                merged.state_dict_metadata[fqn] = copy.copy(item)
                if isinstance(item, TensorStorageMetadata):
                    merged.state_dict_metadata[fqn].chunks = list(item.chunks)
            elif isinstance(have, TensorStorageMetadata):
                seen = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
                have.chunks.extend(c for c in item.chunks if (tuple(c.offsets), tuple(c.sizes)) not in seen)
        merged.planner_data.update(md.planner_data or {})
        for index, info in (md.storage_data or {}).items():
            if index not in merged.storage_data:
                merged.storage_data[index] = dataclasses.replace(info, relative_path=_data_name(old_rank))
    return merged
