"""A training state as a snapshot payload: tensor bytes laid out once, plus a small serialised skeleton.

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
import pickle
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

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
