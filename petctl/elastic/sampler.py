"""`ElasticSampler`: every sample of an epoch read exactly once, whatever the world does mid-epoch.

Why: `DistributedSampler(rank, world_size)` cuts an epoch per rank. When the world goes from 4 to 3 at
step k, the new per-rank cuts no longer line up with the old ones, so "skip k batches" repeats some
samples and skips others. This sampler keeps one cursor for the whole job instead of one per rank:

- each epoch has one order: a seeded permutation (`shuffle=True`, seed + epoch, as DistributedSampler)
  or the dataset's own order;
- the cursor is a position in that order: the samples the whole job has consumed;
- one optimizer step takes the next `global_batch` positions; rank r of W takes positions
  r, r + W, r + 2W, ... of them (its stride), `per_rank` in all;
- the cursor moves on when a step is done (`step_done`, which `Checkpointer.step_end` calls), and it is
  saved with the state. So a resume at any world size continues at the exact position of the kept step.
  A kill that redoes steps re-reads exactly the positions of the redone steps.

The global batch: by default each rank takes `batch_size` per step, so the global batch follows the
world (W x batch_size). With `global_batch=G` it stays G at every world size: each rank takes G / W per
step, in `accumulation` micro-batches of `micro_batch` samples (the largest divisor of G / W that is at
most the `micro_batch` you allow). `plan` says this round's numbers; divide each micro-batch's mean loss by
`plan.accumulation` and DDP's mean over ranks gives the mean over all G samples.

The end of an epoch:
- `drop_last=False` (default): the job reads a stream of epochs. A step that reaches past the end of
  epoch e is filled from the start of epoch e + 1's order. No sample is repeated, padded or dropped,
  every step is full, and each epoch's samples are read exactly once.
- `drop_last=True`: a step never spans two epochs. The tail of an epoch that cannot fill a whole step
  (fewer than `global_batch` samples, at the world size of that moment) is skipped.
- A re-form that lands on an epoch boundary needs nothing special: the cursor is (epoch, offset).

One pass over the sampler (one `iter`) covers the steps that start in the cursor's epoch, from the cursor
on, so a resumed epoch is shorter, and `len` says so. The sampler owns the epoch: `set_epoch`, which
frameworks call, changes nothing.

Pure rules (`plan_batches`, `advance`, `step_starts`, `rank_positions`) are separate from the class so
tests can check them on their own. torch is used for the permutation only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

STATE_VERSION = 1

# The world sizes a job may take, exported by the petctl agent to every worker (docs/ARCHITECTURE.md,
# "Worker environment"): so a fixed global batch that cannot split at some size in [min, max] is refused
# at start, not at the first re-form that reaches that size.
ENV_MIN_WORLD = "PETCTL_MIN_WORLD_SIZE"
ENV_MAX_WORLD = "PETCTL_MAX_WORLD_SIZE"


# --- the batch plan: how a step's samples split over ranks and micro-batches ------------------------------
@dataclass(frozen=True)
class BatchPlan:
    """One round's split of an optimizer step: what the training loop and the DataLoader need."""

    world_size: int
    rank: int
    global_batch: int  # samples per optimizer step, all ranks together
    per_rank: int  # this rank's samples per step (global_batch / world_size)
    micro_batch: int  # the DataLoader's batch size
    accumulation: int  # micro-batches per optimizer step (per_rank / micro_batch)
    fixed: bool  # True: global_batch is the same at every world size (opt in)


def plan_batches(world_size: int, rank: int, *, batch_size: int | None = None,
                 global_batch: int | None = None, micro_batch: int | None = None) -> BatchPlan:
    """The split of one step at `world_size`.

    Either `batch_size` (per rank; the global batch follows the world) or `global_batch` (fixed; each
    rank takes global_batch / world_size), not both. `micro_batch` caps the DataLoader's batch: the plan
    takes the largest divisor of the rank's share that is at most `micro_batch`, so every micro-batch of a
    step has the same size.

    Raises ValueError (one line) on a non-positive size, on both or neither of batch_size/global_batch,
    or when `global_batch` does not split evenly over `world_size` ranks.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if (batch_size is None) == (global_batch is None):
        raise ValueError("ElasticSampler takes batch_size (per rank) or global_batch (fixed), not both "
                         "and not neither")
    for name, value in (("batch_size", batch_size), ("global_batch", global_batch),
                        ("micro_batch", micro_batch)):
        if value is not None and value < 1:
            raise ValueError(f"ElasticSampler: {name} must be at least 1 (got {value})")
    if global_batch is not None:
        if global_batch % world_size:
            raise ValueError(f"global_batch={global_batch} does not split evenly over {world_size} ranks; "
                             f"{_advice(global_batch, [world_size])}")
        per_rank, fixed = global_batch // world_size, True
    else:
        assert batch_size is not None
        per_rank, fixed = batch_size, False
    micro = per_rank if micro_batch is None else largest_divisor_at_most(per_rank, micro_batch)
    return BatchPlan(world_size=world_size, rank=rank, global_batch=per_rank * world_size,
                     per_rank=per_rank, micro_batch=micro, accumulation=per_rank // micro, fixed=fixed)


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest d <= cap that divides n (1 at worst)."""
    return next(d for d in range(min(n, cap), 0, -1) if n % d == 0)


def unsplittable(global_batch: int, world_sizes: Sequence[int]) -> list[int]:
    """The world sizes over which `global_batch` does not split evenly."""
    return [w for w in world_sizes if global_batch % w]


def check_global_batch(global_batch: int, world_sizes: Sequence[int]) -> None:
    """Refuse, at start, a fixed global batch that some reachable world size cannot split.

    Raises ValueError (one line) naming the sizes and the smallest global batch that splits at all of them.
    """
    bad = unsplittable(global_batch, world_sizes)
    if bad:
        sizes = ", ".join(map(str, bad))
        raise ValueError(f"global_batch={global_batch} does not split evenly at world size {sizes} "
                         f"(the job may run at {min(world_sizes)}..{max(world_sizes)}); "
                         f"{_advice(global_batch, world_sizes)}")


def _advice(global_batch: int, world_sizes: Sequence[int]) -> str:
    import math

    lcm = math.lcm(*world_sizes)
    nearest = max(lcm, round(global_batch / lcm) * lcm)
    return f"use a multiple of {lcm} (e.g. {nearest})"


# --- the cursor and its moves -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cursor:
    """Where the job is in its data: the next unread position of epoch `epoch`'s order."""

    epoch: int = 0
    offset: int = 0


def normalize(cursor: Cursor, global_batch: int, size: int, drop_last: bool) -> Cursor:
    """With `drop_last`, a cursor whose epoch has less than a step left moves to the next epoch's start
    (the tail is skipped: which tail depends on the world size when the step would start)."""
    if drop_last and cursor.offset + global_batch > size:
        return Cursor(cursor.epoch + 1, 0)
    return cursor


def advance(cursor: Cursor, global_batch: int, size: int, drop_last: bool) -> Cursor:
    """The cursor after one step of `global_batch` samples (see the module docstring for epoch ends)."""
    at = normalize(cursor, global_batch, size, drop_last)
    epoch, offset = at.epoch, at.offset + global_batch
    if drop_last:
        return normalize(Cursor(epoch, offset), global_batch, size, drop_last)
    epoch, offset = epoch + offset // size, offset % size  # the stream: the step ran into the next epoch
    return Cursor(epoch, offset)


def step_starts(cursor: Cursor, global_batch: int, size: int, drop_last: bool) -> list[Cursor]:
    """Where each step of one pass starts: the steps that begin in the (normalized) cursor's epoch, from
    the cursor on."""
    first = normalize(cursor, global_batch, size, drop_last)
    starts = []
    at = first
    while at.epoch == first.epoch:
        starts.append(at)
        at = advance(at, global_batch, size, drop_last)
    return starts


def rank_positions(start: Cursor, plan: BatchPlan, size: int) -> list[Cursor]:
    """The positions rank `plan.rank` reads in the step starting at `start`: its stride of the step's
    `global_batch` positions. Positions past the epoch's end are in the next epochs (the stream)."""
    out = []
    for i in range(plan.per_rank):
        offset = start.offset + plan.rank + i * plan.world_size
        out.append(Cursor(start.epoch + offset // size, offset % size))
    return out


# --- the sampler --------------------------------------------------------------------------------
class ElasticSampler(Sampler[int]):
    """A `torch.utils.data.Sampler` with one global cursor per job: exactly-once data across world changes.

        sampler = ElasticSampler(dataset, batch_size=32)              # or global_batch=128, micro_batch=16
        loader = DataLoader(dataset, batch_size=sampler.plan.micro_batch, sampler=sampler)
        state = State(model=model, optimizer=opt, stateful={"sampler": sampler})
        start = ckpt.resume(state)                                    # before iter(loader)
        ...
        if ckpt.step_end(step, state):                                # moves the cursor on, then saves

    Without petctl's Checkpointer, call `step_done(step)` after each optimizer step and save
    `state_dict()` with the rest of your state.

    Raises ValueError (one line) for bad sizes, for a fixed global batch that some reachable world size
    cannot split, and for a saved cursor made for another dataset or order.
    """

    def __init__(self, data: Sized | int, batch_size: int | None = None, *, global_batch: int | None = None,
                 micro_batch: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None,
                 world_sizes: Sequence[int] | None = None) -> None:
        self.size = data if isinstance(data, int) else len(data)
        if self.size < 1:
            raise ValueError("ElasticSampler: the dataset is empty")
        rank, world_size = _place(rank, world_size)
        self.plan = plan_batches(world_size, rank, batch_size=batch_size, global_batch=global_batch,
                                 micro_batch=micro_batch)
        if global_batch is not None:
            worlds = list(world_sizes) if world_sizes else reachable_worlds(world_size)
            check_global_batch(global_batch, worlds)
        if drop_last and self.plan.global_batch > self.size:  # normalize would never find a step
            raise ValueError(f"ElasticSampler: drop_last with a global batch of {self.plan.global_batch} "
                             f"leaves nothing of a dataset of {self.size}")
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.cursor = Cursor()
        self.last_step: int | None = None  # the newest step `step_done` counted
        self._generation = 0  # bumped by load_state_dict: an older iterator is stale
        self._orders: dict[int, torch.Tensor] = {}

    # --- the order -------------------------------------------------------------------------------------
    def order(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order of dataset indices (seed + epoch, as DistributedSampler)."""
        cached = self._orders.get(epoch)
        if cached is None:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                cached = torch.randperm(self.size, generator=g)
            else:
                cached = torch.arange(self.size)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # two epochs at most
            self._orders[epoch] = cached
        return cached

    # --- Sampler -----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def steps_left_in_epoch(self) -> int:
        """Steps of the current pass: those that start in the cursor's epoch, from the cursor on."""
        return len(step_starts(self.cursor, self.plan.global_batch, self.size, self.drop_last))

    def __len__(self) -> int:
        return self.steps_left_in_epoch() * self.plan.per_rank

    def __iter__(self) -> Iterator[int]:
        generation, per_rank = self._generation, self.plan.per_rank
        for k, index in enumerate(self.pass_indices()):
            if k % per_rank == 0 and generation != self._generation:
                raise RuntimeError("ElasticSampler: this iterator was made before the sampler's state "
                                   "was loaded; call iter(loader) after Checkpointer.resume")
            yield index

    def pass_indices(self) -> list[int]:
        """This rank's dataset indices for the whole pass, in order (`rank_positions` of each step).

        One slice: a step's global batch is world_size x per_rank, so the rank's positions in step j,
        start + j x global_batch + rank + i x world_size, run on with the same stride from step to step."""
        starts = step_starts(self.cursor, self.plan.global_batch, self.size, self.drop_last)
        plan, first = self.plan, starts[0]
        positions = first.offset + plan.rank + plan.world_size * torch.arange(len(starts) * plan.per_rank)
        epochs, offsets = positions // self.size, positions % self.size
        if int(epochs[-1]) == 0:  # the usual case: the whole pass inside this epoch
            return self.order(first.epoch)[offsets].tolist()
        out = torch.empty_like(positions)
        for e in torch.unique(epochs).tolist():
            mask = epochs == e
            out[mask] = self.order(first.epoch + e)[offsets[mask]]
        return out.tolist()

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the cursor owns the epoch (frameworks call this at each pass)."""

    # --- the cursor moves when a step is done --------------------------------------------------------------
    def step_done(self, step: int | None = None) -> None:
        """One optimizer step consumed its global batch: move the cursor on.

        With `step` (the step just completed), a repeated call for the same step is ignored, and a gap
        (a step whose call was missed) moves the cursor once per missed step. `Checkpointer.step_end`
        calls this before it saves, so a saved cursor is the position after that step.
        """
        moves = 1
        if step is not None and self.last_step is not None:
            moves = step - self.last_step
            if moves <= 0:
                return
        for _ in range(moves):
            self.cursor = advance(self.cursor, self.plan.global_batch, self.size, self.drop_last)
        if step is not None:
            self.last_step = step

    # --- Stateful --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "epoch": self.cursor.epoch, "offset": self.cursor.offset,
                "last_step": self.last_step, "size": self.size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved cursor. Raises ValueError (one line) when it was made for another dataset or order:
        its positions would name other samples."""
        if int(state.get("version", 0)) != STATE_VERSION:
            raise ValueError(f"ElasticSampler: saved state version {state.get('version')} is not "
                             f"{STATE_VERSION}")
        mine = {"size": self.size, "seed": self.seed, "shuffle": self.shuffle}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"ElasticSampler: the saved cursor is for {theirs}, this sampler is {mine}; "
                             "a different dataset or order would read other samples")
        self.cursor = Cursor(int(state["epoch"]), int(state["offset"]))
        last = state.get("last_step")
        self.last_step = None if last is None else int(last)
        self._generation += 1


def endless(loader: Iterable[Any]) -> Iterator[Any]:
    """The batches of `loader`, pass after pass, for a loop that counts steps rather than epochs.

    Each pass is a fresh `iter(loader)`, made when the previous one runs out, so it starts at the
    sampler's cursor. The first is made at the first `next`: after `Checkpointer.resume`.
    Raises RuntimeError when a pass yields nothing (a loader with no data would loop forever).
    """
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise RuntimeError("the DataLoader's pass yielded no batch (is the dataset empty?)")


def reachable_worlds(world_size: int) -> list[int]:
    """Every world size the job may take: from the agent's min/max (ranks, not nodes) when petctl runs
    the job, else this world alone."""
    lo, hi = os.environ.get(ENV_MIN_WORLD), os.environ.get(ENV_MAX_WORLD)
    if not lo or not hi:
        return [world_size]
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        warnings.warn(f"ElasticSampler: {ENV_MIN_WORLD}={lo!r} / {ENV_MAX_WORLD}={hi!r} are not numbers; "
                      "checking this world size only", stacklevel=3)
        return [world_size]
    step = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return sorted({*range(low, high + 1, max(1, step)), world_size})


def _place(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): given, else torch.distributed's, else torchrun's env, else a single process."""
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
