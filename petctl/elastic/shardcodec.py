"""A rank's shard of a sharded state as a snapshot payload, and W such shards loaded back at any world size.

Why not `dcp.save` at every step: it costs about 10 ms of Python per save whatever the state's size
(planning, one `torch.save` per item), most of it holding the GIL against the training thread, so a
1 % budget would snapshot a 50 ms step only every 15 steps. Here a shard is `snapcodec`'s payload (tensor
bytes in fixed places, plus a pickled skeleton): each DTensor is replaced by its local tensor and where
that sits in the global tensor (`shardstate.detach_for_capture`), so the bytes copy runs in torch (GIL
released) and the Python part is a walk of the state dict.

Loading (`assemble`, `load_into`) is DCP's resharding done by hand: every rank holds the W shards of one
save; each DTensor's global tensor is put together from the W local pieces, and every live tensor of the
new world takes its own slice in place (no collective); the other values (step counters, learning rates,
extras) come from old rank 0's shard; then each `Stateful` is given its state dict back
(`load_state_dict`), as `dcp.load` does.
"""

from __future__ import annotations

from typing import Any

import torch

from petctl.elastic.snapcodec import Layout, encode_meta

DTENSOR_KEY = "__petctl_dtensor__"


def encode(captured: tuple[Any, list[torch.Tensor]]) -> tuple[list[torch.Tensor], Layout, bytes]:
    """(tensors, their layout, the meta bytes) of a shard from `shardstate.detach_for_capture`'s
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
        filled[key] = _fill(live, full[key], key)
    for key, value in app_state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(filled[key])


def _fill(live: Any, snap: Any, path: str) -> Any:
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
            live[k] = _fill(live[k], snap[k], f"{path}.{k}")
        return live
    if isinstance(live, list) and isinstance(snap, list) and len(live) == len(snap):
        live[:] = [_fill(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(live, snap, strict=True))]
        return live
    return snap
