"""What a sharded snapshot captures, taken on the training thread: the state dict, with the tensors that
`optimizer.step()` alone changes left live and everything else copied.

Why: the capture runs on a background thread while the next step's forward and backward run. FSDP's
sharded parameters and the optimizer's state change only inside `optimizer.step()` (which a pre-hook holds
until the capture is done), so they are read in place; a module buffer (BatchNorm's running stats), a
user's tensor or extra could change in the next forward, so it is cloned now (small, as a rule).
"""

from __future__ import annotations

import copy
from typing import Any

from petctl.elastic.state import rebuild_dict

_LEAVES = (int, float, str, bool, bytes, type(None))


def find_optimizers(app_state: dict[str, Any]) -> list[Any]:
    """The optimizers in an app state: `ShardedState.optimizer`s and optimizers given directly."""
    import torch

    found = []
    for value in app_state.values():
        opt = value if isinstance(value, torch.optim.Optimizer) else getattr(value, "optimizer", None)
        if isinstance(opt, torch.optim.Optimizer) and all(opt is not o for o in found):
            found.append(opt)
    return found


def _ptr(tensor: Any) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
    return local.data_ptr() if local.numel() else 0


def live_pointers(optimizers: list[Any]) -> set[int]:
    """Storage of what only `optimizer.step()` writes: the parameters and the optimizer's state."""
    import torch

    live = set()
    for opt in optimizers:
        live.update(_ptr(p) for group in opt.param_groups for p in group["params"])
        live.update(_ptr(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    live.discard(0)
    return live


def detach_for_capture(app_state: dict[str, Any], overlap: bool = True) -> dict[str, Any]:
    """A plain state dict of `app_state` (each `Stateful` asked for its `state_dict()` now, on every rank
    at the same step: FSDP's may run collectives) whose tensors are live when only `optimizer.step()`
    changes them (`overlap`) and copies otherwise. Raises what `state_dict()` raises."""
    from torch.distributed.checkpoint.stateful import Stateful

    live = live_pointers(find_optimizers(app_state)) if overlap else set()
    plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in app_state.items()}
    return _copy_unless_live(plain, live)


def _copy_unless_live(obj: Any, live: set[int]) -> Any:
    import torch

    if type(obj) in _LEAVES:
        return obj
    if isinstance(obj, torch.Tensor):
        detached = obj.detach()
        return detached if _ptr(obj) in live else detached.clone()
    if isinstance(obj, dict):
        return rebuild_dict(obj, [(k, _copy_unless_live(v, live)) for k, v in obj.items()], copy.deepcopy)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [_copy_unless_live(v, live) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return copy.deepcopy(obj)
