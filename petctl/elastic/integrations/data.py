"""The frameworks' half of exactly-once data: an `ElasticSampler` read as one endless stream of steps.

Why a stream. A framework cuts training into its own epochs of `len(loader)` batches, a length it fixes
when training starts, and it calls `iter(loader)` once per epoch of its own. On resume it also decides
which batch of its epoch it is at, from counters the checkpoint holds (the Trainer's `global_step`,
Lightning's batch progress), counted at the world size of the save. None of that lines up with
`ElasticSampler`'s passes (the rest of the cursor's epoch, shorter after a resume). So the callbacks give
the framework a `StepStream` instead:

- `iter` starts at the cursor and yields this rank's stride of one step after another, across epoch
  boundaries, without end: whatever the framework's epoch count or resume arithmetic, the next batches it
  reads are the next global step's;
- `len` is one whole epoch at this world size (`nominal_steps` steps): a whole number of steps, so the
  framework's epoch never ends inside a gradient accumulation, and its step-count arithmetic (the
  Trainer's `max_steps` from `num_train_epochs`, Lightning's epoch end) works as for any loader;
- the framework leaves each of its epochs after `len` batches and calls `iter` again: the new iterator
  starts at the cursor, which `step_done` moved once per optimizer step. Nothing is read twice or skipped.

What follows for the user: a run bounded by `max_steps` reads every sample of every epoch exactly once,
across any world change. The framework's own epoch counter counts nominal epochs at the world size of each
moment; a run bounded by epochs (no `max_steps`) turns them into steps at each start's world size, so
after a world change it reads more or fewer epochs than asked (`epoch_bounded_reason`).
Stdlib, torch and `petctl.elastic` only: the frameworks are imported by their own modules.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import Sampler

from petctl.elastic.sampler import (
    STATE_VERSION,
    Cursor,
    ElasticSampler,
    advance,
    normalize,
    rank_positions,
    step_starts,
)
from petctl.io.eventlog import EventLog


def step_indices(sampler: ElasticSampler, start: Cursor) -> list[int]:
    """This rank's dataset indices for the step starting at `start` (its stride, `rank_positions`), through
    the sampler's public order only, so the stream follows the sampler's rules whatever its pass does."""
    positions = rank_positions(start, sampler.plan, sampler.size)
    orders = {e: sampler.order(e) for e in {p.epoch for p in positions}}
    return [int(orders[p.epoch][p.offset]) for p in positions]


def nominal_steps(global_batch: int, size: int, drop_last: bool) -> int:
    """The steps of one whole epoch that starts at its beginning, at a global batch of `global_batch`."""
    return len(step_starts(Cursor(0, 0), global_batch, size, drop_last))


class StepStream(Sampler[int]):
    """An `ElasticSampler` as the framework's sampler: an endless stream of steps from the cursor (see
    the module). The cursor, its state and `step_done` are the wrapped sampler's."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler
        self._generation = 0  # bumped by load_state_dict: an older iterator would read from an old cursor

    @property
    def plan(self) -> Any:
        return self.sampler.plan

    def __len__(self) -> int:
        plan = self.sampler.plan
        return nominal_steps(plan.global_batch, self.sampler.size, self.sampler.drop_last) * plan.per_rank

    def __iter__(self) -> Iterator[int]:
        generation, inner = self._generation, self.sampler
        at = normalize(inner.cursor, inner.plan.global_batch, inner.size, inner.drop_last)
        while True:
            if generation != self._generation:
                raise RuntimeError("StepStream: this iterator was made before the cursor was loaded; the "
                                   "framework must call iter(loader) after its checkpoint is restored")
            yield from step_indices(inner, at)
            at = advance(at, inner.plan.global_batch, inner.size, inner.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the cursor owns the epoch (frameworks call this at each of their epochs)."""

    def step_done(self, step: int) -> None:
        """Optimizer step `step` (0-based) is done: move the cursor on (idempotent per step)."""
        self.sampler.step_done(step)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved cursor (raises ValueError, as `ElasticSampler.load_state_dict`)."""
        self.sampler.load_state_dict(state)
        self._generation += 1

    def assume_steps(self, steps: int) -> None:
        """No cursor was saved with a checkpoint of `steps` completed steps (one made without the callback):
        put the cursor where `steps` steps at this world's global batch from the start would leave it."""
        inner = self.sampler
        self.load_state_dict({"version": STATE_VERSION, "epoch": 0, "offset": 0, "last_step": -1,
                              "size": inner.size, "seed": inner.seed, "shuffle": inner.shuffle})
        if steps > 0:
            inner.step_done(steps - 1)


def build_stream(dataset: Sized, per_rank_micro: int, accumulation: int, *, rank: int, world_size: int,
                 shuffle: bool, seed: int, drop_last: bool) -> StepStream:
    """The stream for a framework whose loader takes `per_rank_micro` samples per batch and steps the
    optimizer every `accumulation` batches: each rank reads `per_rank_micro * accumulation` per step.
    Raises ValueError (one line) as `ElasticSampler` does."""
    sampler = ElasticSampler(dataset, batch_size=per_rank_micro * accumulation, micro_batch=per_rank_micro,
                             shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank,
                             world_size=world_size)
    return StepStream(sampler)


def resume_cursor(stream: StepStream, saved: dict[str, Any] | None, step: int) -> str:
    """Put the cursor where a run resumed at `step` completed steps continues; returns how: "saved" (the
    checkpoint's cursor), "fresh" (step 0, nothing saved) or "assumed" (a checkpoint made without the
    cursor: `assume_steps`, exact only when the world and the order were the same before). Raises
    ValueError when the saved cursor is for another dataset or order."""
    if saved is not None:
        stream.load_state_dict(saved)
        return "saved"
    if step <= 0:
        return "fresh"
    stream.assume_steps(step)
    return "assumed"


def epoch_bounded_reason(framework: str, setting: str) -> str:
    """The one-line warning for a run bounded by epochs, not steps."""
    return (f"petctl: {framework} trains by epochs ({setting}) and turns them into steps at the world size "
            "of each start, so after a world change it reads more or fewer epochs than asked (each sample "
            "it reads still once per epoch): set max_steps for an exact run")


def data_log() -> EventLog:
    """The data tier's event lines (`data.resumed`), on the worker's stdout as the other elastic events."""
    return EventLog("elastic", stream=sys.stdout, rank=int(os.environ.get("RANK", "0")),
                    node_id=os.environ.get("PETCTL_NODE_ID"))


def report_data_resumed(stream: StepStream, step: int, how: str) -> None:
    """One `data.resumed` line for the job (global rank 0): where the data continues, and from what."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    cursor = stream.sampler.cursor
    data_log().emit("data.resumed", step=step, epoch=cursor.epoch, offset=cursor.offset, how=how,
                    world_size=stream.plan.world_size, global_batch=stream.plan.global_batch)
