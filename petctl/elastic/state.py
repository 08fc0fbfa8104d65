"""`State`: what a training job needs to continue exactly where it stopped.

The model, optimizer and LR scheduler, any other object with `state_dict`/`load_state_dict` (a GradScaler,
a stateful sampler), and plain user extras (step, epoch, sampler position). `staged_copy()` copies all of it
to CPU on the calling (training) thread, so the background uploader serialises a frozen copy while the
training loop keeps mutating the live tensors.
"""

from __future__ import annotations

import copy
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from petctl.elastic.manifest import ObjectEntry

STATE_FILE = "state.pt"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def unwrap_model(model: Any) -> Any:
    """The module inside DDP/DataParallel, so a checkpoint's keys don't depend on the wrapper."""
    wrappers: tuple[type, ...] = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    return model.module if isinstance(model, wrappers) else model


def rebuild_dict(obj: dict, items: list[tuple[Any, Any]], keep: Any = None) -> dict:
    """A dict of `obj`'s type holding `items` (a plain dict when a subclass has another constructor), with
    `obj`'s `_metadata` (module state_dicts carry versions `load_state_dict` reads), passed through `keep`
    (e.g. `copy.deepcopy`) or shared when `keep` is None."""
    try:
        out = type(obj)(items)
    except TypeError:  # a dict subclass with another constructor: a plain dict holds the same data
        out = dict(items)
    metadata = getattr(obj, "_metadata", None)
    if metadata is not None and hasattr(out, "__dict__"):
        out._metadata = keep(metadata) if keep else metadata  # type: ignore[attr-defined]
    return out


def to_cpu(obj: Any, reuse: Any = None) -> Any:
    """A deep copy with every tensor copied to CPU (a copy even for CPU tensors: the live one moves on).

    `reuse`: an earlier copy of the same structure that nobody reads any more (its upload is done).
    Tensors of the same shape and dtype are copied into it instead of into fresh memory: a fresh 100 MB
    buffer costs the training thread its page faults (about 6x the copy itself, measured here).
    """
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if _fits(reuse, src):
            return reuse.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return rebuild_dict(obj, [(k, to_cpu(v, old.get(k))) for k, v in obj.items()], copy.deepcopy)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        old_items = reuse if isinstance(reuse, type(obj)) and len(reuse) == len(obj) else [None] * len(obj)
        copied = [to_cpu(v, r) for v, r in zip(obj, old_items, strict=True)]
        return copied if isinstance(obj, list) else tuple(copied)
    return copy.deepcopy(obj)


def _fits(buffer: Any, src: torch.Tensor) -> bool:
    return (isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and buffer.shape == src.shape
            and buffer.dtype == src.dtype and buffer.layout == torch.strided == src.layout
            and not src.is_quantized and not buffer.is_quantized)


@dataclass
class State:
    """The training state petctl.elastic saves and restores. Every field is optional.

    `extra` is restored in place (the same dict object), so code holding a reference to it sees the
    loaded values after `Checkpointer.resume`.
    """

    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    stateful: dict[str, Stateful] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """References to the live state (no copy); use `staged_copy` to save it."""
        out: dict[str, Any] = {"extra": self.extra}
        if self.model is not None:
            out["model"] = unwrap_model(self.model).state_dict()
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.stateful:
            out["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        return out

    def staged_copy(self, reuse: dict[str, Any] | None = None) -> dict[str, Any]:
        """The staged copy an upload writes: a CPU copy, independent of the live objects, safe to
        serialise on another thread. ("Snapshot" is the in-memory tier's word only.)

        `reuse`: a previous staged copy that is no longer read; its tensors are overwritten (see to_cpu).
        """
        return to_cpu(self.state_dict(), reuse)

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore from `state_dict`/`staged_copy` output; missing parts leave the live objects as they
        are."""
        if self.model is not None and "model" in data:
            unwrap_model(self.model).load_state_dict(data["model"])
        if self.optimizer is not None and "optimizer" in data:
            self.optimizer.load_state_dict(data["optimizer"])
        if self.scheduler is not None and "scheduler" in data:
            self.scheduler.load_state_dict(data["scheduler"])
        for name, obj in self.stateful.items():
            if name in data.get("stateful", {}):
                obj.load_state_dict(data["stateful"][name])
        self.extra.update(data.get("extra", {}))


class ShardedState:
    """A DCP `Stateful` for a (possibly FSDP-wrapped) model and optimizer plus plain extras.

    `get_state_dict`/`set_state_dict` give sharded state dicts for FSDP and plain ones otherwise.
    """

    def __init__(self, model: Any, optimizer: Any = None, extra: dict[str, Any] | None = None,
                 stateful: dict[str, Stateful] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra = extra if extra is not None else {}
        self.stateful = stateful if stateful is not None else {}  # an ElasticSampler, say: same on all ranks

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optimizers = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        out = {"model": model_sd, "optim": optim_sd, "extra": dict(self.extra)}
        if self.stateful:
            out["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"] if optimizers else {})
        self.extra.update(state_dict.get("extra", {}))
        for name, obj in self.stateful.items():
            if name in state_dict.get("stateful", {}):
                obj.load_state_dict(state_dict["stateful"][name])


class _HashingWriter:
    """File wrapper that hashes what torch.save writes, so the manifest needs no second read pass."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.size += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def save_staged(staged: dict[str, Any], step: int,
                directory: Path) -> tuple[dict[str, Path], list[ObjectEntry]]:
    """Serialise a staged copy into `directory`: ({object name: path}, their manifest entries)."""
    path = directory / STATE_FILE
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save({"step": step, "state": staged}, writer)
    return {STATE_FILE: path}, [ObjectEntry(STATE_FILE, writer.size, writer.sha.hexdigest())]


def load_payload(source: Path | bytes, weights_only: bool = True) -> tuple[int, dict[str, Any]]:
    """(step, payload: the saved state dict) from a saved file or its bytes, always onto CPU
    (load_state_dict moves it).

    `weights_only=True` (torch's safe unpickler) accepts tensors and plain containers/numbers/strings;
    pass False for extras holding arbitrary Python objects, only for checkpoints you trust.
    """
    f: Any = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    payload = torch.load(f, map_location="cpu", weights_only=weights_only)
    return int(payload["step"]), payload["state"]
