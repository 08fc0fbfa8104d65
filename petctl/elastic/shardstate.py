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

from petctl.elastic.shardcodec import DTENSOR_KEY
from petctl.elastic.snapcodec import TENSOR_KEY
from petctl.elastic.state import ShardedState, rebuild_dict

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


class StateDicts:
    """`ShardedState.state_dict()` at every snapshot without `get_state_dict`'s per-call cost (option
    checks over every module, about 0.2 ms of the 0.5 ms a small model's snapshot costs the training
    thread): the model's own `state_dict()` and the optimizer's, its parameter numbers renamed to the
    names `get_state_dict` gives them. The names are learnt from one `get_state_dict` call and used only
    when the result then matched it key for key; otherwise every call is `get_state_dict`'s."""

    def __init__(self) -> None:
        self.names: dict[int, list[str] | None] = {}  # id(ShardedState) -> parameter number -> name
        self._live: tuple[Any, set[int]] | None = None

    def live(self, app_state: dict[str, Any]) -> set[int]:
        """`live_pointers` of the app state's optimizers, again only when their state may have changed
        (other optimizers, a new state dict: `load_state_dict`, or more parameters with state: the state
        is made lazily)."""
        optimizers = find_optimizers(app_state)
        key = tuple((id(o), id(o.state), len(o.state)) for o in optimizers)
        if self._live is None or self._live[0] != key:
            self._live = (key, live_pointers(optimizers))
        return self._live[1]

    def of(self, value: Any) -> Any:
        """`value.state_dict()`, or its equal, cheaper (see the class)."""
        names = self.names.get(id(value))
        if names is None:
            full = value.state_dict()
            if id(value) not in self.names and _plain_sharded_state(value):
                learnt = [n for group in full["optim"]["param_groups"] for n in group["params"]]
                self.names[id(value)] = learnt if _same_keys(self._quick(value, learnt), full) else None
            return full
        return self._quick(value, names)

    @staticmethod
    def _quick(value: Any, names: list[str]) -> dict[str, Any]:
        osd = value.optimizer.state_dict()
        state = {names[i]: v for i, v in osd["state"].items()}
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
        return {"model": value.model.state_dict(), "optim": {"state": state, "param_groups": groups},
                "extra": dict(value.extra)}


def _plain_sharded_state(value: Any) -> bool:
    return type(value) is ShardedState and value.optimizer is not None


def _same_keys(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_keys(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_keys(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and (not isinstance(a, str) or a == b)


def detach_for_capture(app_state: dict[str, Any], overlap: bool = True,
                       offsets: dict[Any, list[int]] | None = None,
                       state_dicts: StateDicts | None = None) -> tuple[Any, list[Any]]:
    """(skeleton, tensors) of `app_state`: each `Stateful` asked for its `state_dict()` now (on every
    rank at the same step: FSDP's may run collectives), every tensor moved to `tensors` and replaced by
    `{snapcodec.TENSOR_KEY: i}`, each DTensor by its local piece and where that sits
    (`{shardcodec.DTENSOR_KEY: [piece, global shape, global offset]}`). A tensor stays live when only
    `optimizer.step()` changes it (`overlap`) and is copied otherwise. `offsets` caches where a DTensor's
    piece sits (the same for the life of a world). One walk: it runs on the training thread at every
    snapshot. Raises what `state_dict()` raises."""
    from torch.distributed.checkpoint.stateful import Stateful

    live = (state_dicts.live(app_state) if state_dicts is not None else
            live_pointers(find_optimizers(app_state))) if overlap else set()
    tensors: list[Any] = []
    walk = _Walk(live, {} if offsets is None else offsets, tensors)
    of = state_dicts.of if state_dicts is not None else (lambda v: v.state_dict())
    skeleton = {k: walk(of(v) if isinstance(v, Stateful) else v) for k, v in app_state.items()}
    return skeleton, tensors


class _Walk:
    def __init__(self, live: set[int], offsets: dict[Any, list[int]], tensors: list[Any]) -> None:
        import torch

        self.live, self.offsets, self.tensors, self.tensor_type = live, offsets, tensors, torch.Tensor

    def __call__(self, obj: Any) -> Any:
        if type(obj) in _LEAVES:
            return obj
        if isinstance(obj, self.tensor_type):
            local = getattr(obj, "_local_tensor", None)  # a DTensor: its piece on this rank
            plain = (obj if local is None else local).detach()
            self.tensors.append(plain if _ptr(plain) in self.live else plain.clone())
            marker = {TENSOR_KEY: len(self.tensors) - 1}
            if local is None:
                return marker
            return {DTENSOR_KEY: [marker, list(obj.shape), _offset(obj, self.offsets)]}
        if isinstance(obj, dict):
            return rebuild_dict(obj, [(k, self(v)) for k, v in obj.items()])  # pickled at once: copied
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            items = [self(v) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)


def _offset(dtensor: Any, offsets: dict[Any, list[int]]) -> list[int]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    key = (tuple(dtensor.shape), id(dtensor.device_mesh), tuple(dtensor.placements))
    found = offsets.get(key)
    if found is None:
        _shape, offset = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh,
                                                               dtensor.placements)
        found = offsets[key] = list(offset)
    return found
