"""The in-memory tier's wire formats: a state as a snapshot payload (replicated), a rank's DTensor shard as
one (sharded), and the shard file that bundles a header with such a payload.

Sections below: the payload layout and codec (`Layout`, `encode_meta`, `decode`), the sharded codec
(`encode`, `assemble`, `load_into`), and the shard bundle file (`pack`, `unpack`, `stage`, `commit`,
`read_verified`).

A training state as a snapshot payload: tensor bytes laid out once, plus a small serialised skeleton.

Why not `torch.save` every step: serialising 100 MB costs the training thread tens of milliseconds. Here
the tensors' bytes are copied straight into fixed, aligned places of the payload (`Layout`), which stays
the same from one step to the next while the shapes do; everything else (the dicts around the tensors,
step counters, learning rates, the user's extras) is a skeleton in which each tensor is replaced by
`{TENSOR_KEY: i}`, pickled (about 15 us here; `torch.save` took 75-130 us, most of a small state's cost).

    payload = [tensor 0][pad][tensor 1][pad]...[meta = pickle({"skeleton", "tensors"})]

With `weights_only` (the default) the skeleton is read back by a restricted unpickler that accepts only
plain containers and numbers, OrderedDict, torch dtypes, `torch.Size`, `torch.device` and what the user
allowed with `torch.serialization.add_safe_globals`, as `torch.load(weights_only=True)` would; anything
else makes the snapshot unloadable (`SkeletonRefused`: the resume falls back to the store). Tensors that
are not plain strided dense tensors (sparse, quantized) stay inside the skeleton, so they need
`weights_only=False` to come back from a snapshot.
"""

from __future__ import annotations

import io
import os
import pickle
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import HEADER_SIZE, SnapshotHeader, snapshot_path, stale_reason
from petctl.elastic.state import rebuild_dict

TENSOR_KEY = "__petctl_tensor__"
CHECK_BLOCK = 4096  # 64-bit words per block of the payload checksum (32 KiB)
_LEAVES = (int, float, str, bool, bytes, type(None))
ALIGN = 64  # each tensor starts on a cache line: aligned for every dtype, and for vectorised copies


@dataclass(frozen=True)
class Slot:
    """Where tensor i of the skeleton lives in the payload."""

    offset: int
    numel: int
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Layout:
    """The tensor region of a payload: one slot per tensor, in skeleton order."""

    slots: tuple[Slot, ...]
    data_length: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> Layout:
        offset, slots = 0, []
        for t in tensors:
            slot = Slot(offset, t.numel(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
            slots.append(slot)
            offset = _aligned(offset + slot.nbytes)
        return cls(tuple(slots), offset)

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """The same shapes and dtypes as when laid out: the same places can take them."""
        return len(tensors) == len(self.slots) and all(
            s.shape == tuple(t.shape) and s.dtype == str(t.dtype).removeprefix("torch.")
            for s, t in zip(self.slots, tensors, strict=True))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"snapshot names an unknown dtype {name!r}")
    return value


def _plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


def flatten(obj: Any, tensors: list[torch.Tensor], roots: list[str], root: str = "") -> Any:
    """`obj` with every plain tensor moved to `tensors` (its top-level key to `roots`) and replaced by
    `{TENSOR_KEY: index}`. Containers are new objects; other leaves are shared (the caller serialises the
    skeleton at once, which copies them)."""
    if type(obj) in _LEAVES:
        return obj
    if isinstance(obj, torch.Tensor) and _plain(obj):
        tensors.append(obj.detach())
        roots.append(root)
        return {TENSOR_KEY: len(tensors) - 1}
    if isinstance(obj, dict):
        # the metadata shared, not copied: the skeleton is serialised (copied) at once
        return rebuild_dict(obj, [(k, flatten(v, tensors, roots, root or str(k))) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [flatten(v, tensors, roots, root) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def encode_meta(skeleton: Any, layout: Layout) -> bytes:
    """The meta bytes: the skeleton and the tensor table, pickled."""
    table = [(s.offset, s.numel, s.dtype, s.shape) for s in layout.slots]
    return pickle.dumps({"skeleton": skeleton, "tensors": table}, protocol=pickle.HIGHEST_PROTOCOL)


class SkeletonRefused(pickle.UnpicklingError):
    """The skeleton holds an object the weights-only loader does not accept."""


_SAFE: dict[str, Any] = {"collections.OrderedDict": OrderedDict, "torch.Size": torch.Size,
                         "torch.device": torch.device}


class _WeightsOnly(pickle.Unpickler):
    """Refuses every global but plain data's (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key in _SAFE:
            return _SAFE[key]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        for entry in torch.serialization.get_safe_globals():
            obj, named = (entry[0], entry[1]) if isinstance(entry, tuple) else (entry, None)
            if key in (named, f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"):
                return obj
        raise SkeletonRefused(f"{key} is not allowed with weights_only=True (pass Checkpointer("
                              "weights_only=False) if you trust this node, or torch.serialization."
                              "add_safe_globals)")


def load_meta(data: bytes, weights_only: bool = True) -> Any:
    """The meta a payload carries. Raises SkeletonRefused (weights-only) or pickle's errors."""
    return _WeightsOnly(io.BytesIO(data)).load() if weights_only else pickle.loads(data)


def payload_checksum(buffer: Any, offset: int, length: int) -> int:
    """The checksum of `length` bytes of `buffer` from `offset` (8-byte aligned): crc32 over the sequence
    of the 64-bit (wrapping) sums of its 32 KiB blocks, then over the bytes past the last whole block.

    Why not crc32 over the bytes: it is CPU-bound (24 ms per 100 MB here on a quiet core, 150-250 ms on
    the loaded machine) and runs beside training at every step; the block sums are one memory-bound pass
    (5 to 17 ms). Any changed bit changes its block's sum, a block moved or lost changes the sequence, so
    damage after the commit is caught; what it misses is words swapped within one block (never loaded
    then: the writer commits only after its own copy, and a torn write is caught by the header alone)."""
    blocks = length // (8 * CHECK_BLOCK)
    crc = 0
    if blocks:
        words = torch.frombuffer(buffer, dtype=torch.int64, count=blocks * CHECK_BLOCK, offset=offset)
        crc = zlib.crc32(words.view(blocks, CHECK_BLOCK).sum(dim=1).numpy().tobytes())
    tail = offset + blocks * 8 * CHECK_BLOCK
    with memoryview(buffer) as view, view[tail:offset + length] as rest:
        return zlib.crc32(rest, crc)


def tensor_view(buffer: Any, slot: Slot, base: int = 0) -> torch.Tensor:
    """A tensor viewing `slot`'s bytes in `buffer` (an mmap, a bytearray), `base` bytes in."""
    dtype = _dtype(slot.dtype)
    if slot.numel == 0:
        return torch.empty(slot.shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=slot.numel, offset=base + slot.offset).view(slot.shape)


def decode(payload: bytearray, data_length: int, meta_offset: int, meta_length: int,
           weights_only: bool = True) -> dict[str, Any]:
    """The state a payload holds, its tensors copied out of `payload`: the live objects may keep what they
    are given (`Optimizer.load_state_dict` keeps CPU tensors as they are), and a view would keep the whole
    payload alive with them. Raises ValueError on an inconsistent payload, SkeletonRefused (a
    pickle.UnpicklingError) on a skeleton `weights_only` refuses."""
    meta = load_meta(bytes(memoryview(payload)[meta_offset:meta_offset + meta_length]), weights_only)
    slots = [Slot(int(o), int(n), str(d), tuple(int(x) for x in s)) for o, n, d, s in meta["tensors"]]
    if any(s.offset + s.nbytes > data_length for s in slots):
        raise ValueError("snapshot tensor table points past the data region")
    tensors = [tensor_view(payload, s).clone() for s in slots]
    return _fill(meta["skeleton"], tensors)


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton with its markers replaced by the tensors (containers changed in place)."""
    if isinstance(obj, dict):
        if len(obj) == 1 and TENSOR_KEY in obj:
            return tensors[int(obj[TENSOR_KEY])]
        for key, value in obj.items():
            obj[key] = _fill(value, tensors)
        return obj
    if isinstance(obj, list):
        obj[:] = [_fill(v, tensors) for v in obj]
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_fill(v, tensors) for v in obj)
    return obj


# --- the sharded codec --------------------------------------------------------------------------------------
# A rank's shard of a sharded state as a snapshot payload, and W such shards loaded back at any world size.
#
# Why not `dcp.save` at every step: it costs about 10 ms of Python per save whatever the state's size
# (planning, one `torch.save` per item), most of it holding the GIL against the training thread, so a
# 1 % budget would snapshot a 50 ms step only every 15 steps. Here a shard is `codec`'s payload (tensor
# bytes in fixed places, plus a pickled skeleton): each DTensor is replaced by its local tensor and where
# that sits in the global tensor (`ring.detach_for_capture`), so the bytes copy runs in torch (GIL
# released) and the Python part is a walk of the state dict.
#
# Loading (`assemble`, `load_into`) is DCP's resharding done by hand: every rank holds the W shards of one
# save; each DTensor's global tensor is put together from the W local pieces, and every live tensor of the
# new world takes its own slice in place (no collective); the other values (step counters, learning rates,
# extras) come from old rank 0's shard; then each `Stateful` is given its state dict back
# (`load_state_dict`), as `dcp.load` does.


DTENSOR_KEY = "__petctl_dtensor__"


def encode(captured: tuple[Any, list[torch.Tensor]]) -> tuple[list[torch.Tensor], Layout, bytes]:
    """(tensors, their layout, the meta bytes) of a shard from `ring.detach_for_capture`'s
    (skeleton, tensors): the training thread's part (no copy of tensor data: the caller copies
    `tensors` into the payload)."""
    skeleton, tensors = captured
    layout = Layout.of(tensors)
    return tensors, layout, encode_meta(skeleton, layout)


def _region(offset: Any, shape: Any) -> tuple[slice, ...]:
    """Where a local piece of `shape` at `offset` sits in its global tensor."""
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _is_marker(obj: Any) -> bool:
    return isinstance(obj, dict) and len(obj) == 1 and DTENSOR_KEY in obj


def assemble(shards: list[Any]) -> Any:
    """One state from the decoded shards of every old rank (old rank order): each DTensor's global
    tensor from its local pieces, anything else from old rank 0's. Raises ValueError when the shards'
    structures differ."""
    first = shards[0]
    if _is_marker(first):
        _local, shape, _offset = first[DTENSOR_KEY]
        full = torch.zeros(shape, dtype=_local.dtype)
        for shard in shards:
            if not _is_marker(shard):
                raise ValueError("a tensor is sharded in one shard and not in another")
            local, _shape, offset = shard[DTENSOR_KEY]
            full[_region(offset, local.shape)] = local
        return full
    if isinstance(first, dict):
        if any(not isinstance(s, dict) or s.keys() != first.keys() for s in shards):
            raise ValueError("shards of one save with different keys")
        return {k: assemble([s[k] for s in shards]) for k in first}
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        if any(not isinstance(s, type(first)) or len(s) != len(first) for s in shards):
            raise ValueError("shards of one save with different lists")
        items = [assemble([s[i] for s in shards]) for i in range(len(first))]
        return items if isinstance(first, list) else tuple(items)
    return first


def load_into(app_state: dict[str, Any], full: dict[str, Any]) -> None:
    """Load an assembled state into `app_state` in place: each `Stateful`'s state dict (of the new world)
    filled and given back to it, plain tensors copied into. Raises KeyError/ValueError when the state
    does not match (another model), before any `load_state_dict`: the store is used instead."""
    from torch.distributed.checkpoint.stateful import Stateful

    filled = {}
    for key, value in app_state.items():
        if key not in full:
            raise KeyError(f"the snapshot holds no {key!r}")
        live = value.state_dict() if isinstance(value, Stateful) else value
        filled[key] = _fill_live(live, full[key], key)
    for key, value in app_state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(filled[key])


def _fill_live(live: Any, snap: Any, path: str) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(live, torch.Tensor):
        if not isinstance(snap, torch.Tensor) or tuple(snap.shape) != tuple(live.shape):
            raise ValueError(f"{path}: the snapshot's value does not fit ({getattr(snap, 'shape', snap)})")
        if isinstance(live, DTensor):
            shape, offset = compute_local_shape_and_global_offset(live.shape, live.device_mesh,
                                                                  live.placements)
            with torch.no_grad():
                live.to_local().copy_(snap[_region(offset, shape)])
        else:
            with torch.no_grad():
                live.copy_(snap)
        return live
    if isinstance(live, dict):
        missing = live.keys() - snap.keys() if isinstance(snap, dict) else live.keys()
        if missing:
            raise KeyError(f"{path}: the snapshot lacks {sorted(map(str, missing))[:5]}")
        for k in list(live):
            live[k] = _fill_live(live[k], snap[k], f"{path}.{k}")
        return live
    if isinstance(live, list) and isinstance(snap, list) and len(live) == len(snap):
        live[:] = [_fill_live(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(live, snap, strict=True))]
        return live
    return snap


# --- the shard file (bundle) --------------------------------------------------------------------------------
# One rank's shard of a sharded snapshot as one file: the in-memory snapshot header, then DCP's bytes.
#
#     [SnapshotHeader][payload: the local tensors' bytes][meta: the pickled skeleton (`codec`)]
#
# The header is `petctl.core.snapshotrecord`'s (job, round, step, old rank, world size, lengths, checksum),
# so to the agent a shard file is one more snapshot: bytes behind a header. The file is built in memory
# off the training thread (`pack`: no collective, the bytes copied by torch), then written.
#
# Never torn: a file is written to `<name>.tmp` and renamed into place (`stage`, `commit`); a reader checks
# the header's own crc, the job and round (`stale_reason`) and the payload's checksum (`read_verified`).


OWN, PEER = "own", "peer"
# The save before the newest, kept until every rank has committed the newest (ring.exchange): a kill
# while the ranks commit leaves some with the new save and some with the old one only.
OWN_BEFORE, PEER_BEFORE = "own-before", "peer-before"
SHARD_KINDS = (OWN, PEER, OWN_BEFORE, PEER_BEFORE)


def shard_path(directory: Path | str, kind: str, local_rank: int) -> Path:
    """A shard file of this node's local rank `local_rank`: its own (`OWN`), the copy it keeps for the
    previous node (`PEER`), or the save before either (`OWN_BEFORE`, `PEER_BEFORE`)."""
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


def commit(staged: Path, path: Path, keep: Path | None = None) -> None:
    """Make a staged file the newest snapshot at `path` (atomic: readers see the old or the new one).
    `keep`: move the file at `path` there first, so the save it holds stays readable. Raises OSError."""
    if keep is not None:
        try:
            os.replace(path, keep)
        except FileNotFoundError:
            pass  # the first save: nothing before it
    os.replace(staged, path)
