"""The ring sharded snapshots travel on: rank r sends its shard to rank r + local world size (the same
local rank on the next node, mod world) and keeps the one rank r - local world size sends, on a gloo group
of its own (made collectively with the checkpointer: its operations run on the snapshot thread, and must
never interleave with the training thread's on the default group). Every rank calls the same operations
in the same order (the snapshot steps are agreed), so the group never deadlocks on a live job."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from petctl.elastic.shardbundle import commit, stage

TIMEOUT = datetime.timedelta(seconds=120)  # a neighbour gone: the job re-forms long before this


@dataclass
class ShardRing:
    rank: int
    next: int
    prev: int
    group: Any = None  # None: a single process (no peer, nothing to agree with)

    @classmethod
    def create(cls, comm: Any, local_world: int) -> ShardRing:
        """Collective when `comm` is distributed (every rank makes it, at the same point)."""
        world = comm.world_size
        group = dist.new_group(backend="gloo", timeout=TIMEOUT) if comm.distributed else None
        return cls(comm.rank, (comm.rank + local_world) % world, (comm.rank - local_world) % world, group)

    @property
    def has_peer(self) -> bool:
        """Another node to keep a copy: false on a one-node job, whose loss no copy in it could cover."""
        return self.group is not None and self.next != self.rank

    def all_max(self, *values: int) -> tuple[int, ...]:
        """The maximum of each value over every rank (one all-reduce)."""
        if self.group is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(v) for v in t.tolist())

    def swap(self, buf: bytearray) -> bytearray:
        """Send `buf` to the next node's rank; what the previous node's rank sent (its size first)."""
        size, theirs = torch.tensor([len(buf)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        self._pair(size, theirs)
        received = bytearray(int(theirs.item()))
        self._pair(torch.frombuffer(buf, dtype=torch.uint8), torch.frombuffer(received, dtype=torch.uint8))
        return received

    def _pair(self, out: torch.Tensor, into: torch.Tensor) -> None:
        works = [dist.isend(out, self.next, group=self.group), dist.irecv(into, self.prev, group=self.group)]
        for work in works:
            work.wait()


def exchange(ring: ShardRing, own: Path, peer: Path, buf: bytearray | None, proposal: int,
             error: str | None) -> tuple[str | None, int]:
    """One snapshot's round on the ring, the same operations on every rank: agree on the next K (the
    largest proposed) and on every capture having worked; swap shard files with the neighbours; stage
    both; agree every rank staged both; only then rename both into place (a kill at any moment leaves,
    for every shard, the new save or the previous one whole on two nodes). (None, agreed K), or (why
    snapshots stop here, K). Raises what gloo raises when a neighbour is gone (the job re-forms then)."""
    every, failed = ring.all_max(proposal, int(buf is None))
    if failed:
        return error or "a capture failed on another rank", every
    assert buf is not None
    staged: list[tuple[Path, Path]] = []
    try:
        staged.append((stage(own, buf), own))
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    if ring.has_peer:
        received = ring.swap(buf)  # every rank swaps, staged or not: the ring stays in step
        try:
            staged.append((stage(peer, received), peer))
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    if ring.all_max(int(error is not None))[0]:  # commit only when every rank staged both
        for tmp, _path in staged:
            tmp.unlink(missing_ok=True)
        return error or "staging a shard failed on another rank", every
    for tmp, path in staged:
        commit(tmp, path)
    return None, every
