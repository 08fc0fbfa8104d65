"""Small torch.distributed helpers that also work in a single process (dist not initialised).

Checkpoint coordination is control traffic (a flag, a few hundred MB once at start), so it runs on a
gloo group over CPU tensors even when training uses NCCL: no GPU memory, no stream syncs, and the same
code on CPU-only test machines. The gloo group is created once per `Comm` (a collective call, so every
rank must create its `Comm` at the same point: `Checkpointer.__init__`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass
class Comm:
    """Rank facts and the CPU collectives petctl.elastic needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None  # the gloo process group (None: the default group, or no dist at all)
    distributed: bool = False
    _owns_group: bool = field(default=False, repr=False)

    @classmethod
    def create(cls) -> Comm:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not is_distributed():
            # Without dist every process acts alone; RANK still decides who writes, so torchrun scripts
            # that never call init_process_group don't have every rank uploading the same bytes.
            return cls(rank=int(os.environ.get("RANK", "0")), world_size=1, local_rank=local_rank)
        group = None
        owns = False
        if dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
            owns = True
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                   group=group, distributed=True, _owns_group=owns)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def any_true(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank (all-reduce MAX of one CPU int)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` from rank `src` on every rank (pickled; bytes objects go through unchanged)."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def close(self) -> None:
        if self._owns_group and self.group is not None and is_distributed():
            dist.destroy_process_group(self.group)
        self.group = None
        self._owns_group = False
