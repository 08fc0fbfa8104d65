"""The Hugging Face `Trainer` integration: its callback and its half of the in-memory snapshot tier.

The Hugging Face `Trainer` under petctl: true status, and no step lost at a notice or planned change.

    from petctl.elastic.integrations.transformers import PetctlCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[PetctlCallback()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))  # or True, or petctl's
                                                                                 # last_checkpoint

What the callback does (`protocol.SaveNowProtocol` holds the framework-neutral half):
- every completed optimizer step is a `train.step` line, every checkpoint the Trainer writes a
  `checkpoint.saved` line: `petctl status` shows the step, and goodput and lost steps are true;
- at petctl's save-now flag (spot notice, planned scale change) every rank agrees on the same step in one
  all-reduce, and the callback sets `control.should_save` and `control.should_training_stop`: the Trainer
  writes `checkpoint-<step>` at that step boundary and leaves its loop, the workers exit 0, and the next
  round resumes at the step after it. At a rebalance recommendation it sets `should_save` only.
- every sample read exactly once across world changes (`data=True`, the default; the Trainer's half is
  below, `data.py` the framework-neutral half): the Trainer's sampler becomes an `ElasticSampler`;
- a node lost without warning costs at most one step, however the script finds its checkpoint (the
  in-memory tier, below).
Its cost: one all-reduce of three integers per step (`check_every=1`; raise it for very short steps).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, has_length

from petctl.core.snapshotrecord import ENV_SNAPSHOT_DIR
from petctl.elastic.integrations.data import (
    StepStream,
    build_stream,
    epoch_bounded_reason,
    report_data_resumed,
    resume_cursor,
)
from petctl.elastic.integrations.memory import FrameworkSnapshots
from petctl.elastic.integrations.protocol import Action, ProtocolCallback
from petctl.elastic.snapshots import SnapshotOptions
from petctl.io.files import atomic_write

# --- the Trainer's half of the in-memory tier ---------------------------------------------------------------
# The Hugging Face `Trainer`'s half of the in-memory snapshot tier (`memory.py`).
#
# What is kept, at each step end (`on_step_end`: after the optimizer and scheduler stepped and
# `global_step` counted the step): the model's and the optimizer's state dicts (the optimizer's parameters
# and state are copied beside the next step when the state is large, as for `Checkpointer`), the
# scheduler's, the `TrainerState` (its JSON: `global_step`, epoch, log history) and the writing rank's RNG
# states (Python, NumPy, torch CPU), which is what the Trainer's own `checkpoint-N/` holds.
#
# How a job resumes from it: the Trainer reads its checkpoint only from a directory
# (`train(resume_from_checkpoint=...)`), and skips the batches it already trained on from there, so the
# snapshot is resumed *through* one. In `on_init_end` (the process group is up, `train()` not called yet)
# every rank takes part in the snapshot exchange against the newest `checkpoint-N` in `output_dir`; when
# memory wins, every rank writes the snapshot it received as `checkpoint-<step>/` into its node's tmpfs
# (`$PETCTL_SNAPSHOT_DIR/hf-resume-<local rank>/`, never the shared output directory) and
# `trainer.train` takes it in place of the older checkpoint the script asked for: a script resumes from
# memory whether it passes `get_last_checkpoint(output_dir)` (found before or after the Trainer was built),
# `True`, None, or petctl's `last_checkpoint(output_dir)` (`resume_choice`). Nothing is written into
# `output_dir`, which nodes may share. RNG: the rank that wrote the snapshot gets its generators back
# (`rng_state_<rank>.pth`); other ranks keep their own seeds, as the Trainer does for a rank its
# checkpoint has no RNG file for.


MARK = "resume.json"  # {"round", "step", "path"}: the checkpoint this round resumes from memory


def checkpoint_step(path: str | None) -> int | None:
    """The step of a `checkpoint-N` directory (None for None)."""
    found = re.search(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)$", str(path or "").rstrip("/"))
    return int(found.group(1)) if found else None


def newest_on_disk(output_dir: str) -> int | None:
    return checkpoint_step(get_last_checkpoint(output_dir)) if os.path.isdir(output_dir) else None


def resume_dir(environ: dict[str, str] | None = None) -> Path | None:
    """Where this worker writes the checkpoint it resumes from memory (None outside the agent)."""
    env = os.environ if environ is None else environ
    directory = env.get(ENV_SNAPSHOT_DIR, "")
    return Path(directory) / f"hf-resume-{env.get('LOCAL_RANK', '0')}" if directory else None


def memory_checkpoint(environ: dict[str, str] | None = None) -> str | None:
    """The checkpoint directory the callback wrote from memory for *this* round, or None."""
    env = os.environ if environ is None else environ
    where = resume_dir(env)
    try:
        mark = json.loads((where / MARK).read_text()) if where is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or str(mark.get("round")) != env.get("PETCTL_ROUND", "0"):
        return None
    return mark.get("path") if os.path.isdir(str(mark.get("path"))) else None


def resume_choice(given: str | bool | None, from_memory: str | None, output_dir: str) -> str | bool | None:
    """What `trainer.train(resume_from_checkpoint=given)` resumes from when the callback wrote this round's
    checkpoint from node memory (`from_memory`, None when memory lost to the disk or held nothing).

    Memory replaces what a resuming script asks for: True (the Trainer's own newest), None or False
    (`get_last_checkpoint` found nothing on disk: a kill before the first save), or a `checkpoint-N` of
    `output_dir` no newer than memory's (`get_last_checkpoint` found an older one, before or after the
    Trainer was built). Any other path (another directory, a newer step) is the script's own choice: kept.
    """
    if from_memory is None:
        return given
    if given is None or isinstance(given, bool):
        return from_memory
    asked, kept = checkpoint_step(str(given)), checkpoint_step(from_memory)
    parent = os.path.realpath(os.path.dirname(str(given).rstrip("/")))
    if asked is not None and kept is not None and asked <= kept and parent == os.path.realpath(output_dir):
        return from_memory
    return given


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's wrapper (its step pre-hooks are the ones that run)."""
    return getattr(optimizer, "optimizer", optimizer)


def capture(state: Any, model: Any, optimizer: Any, scheduler: Any, rank: int) -> dict[str, Any]:
    """What the Trainer's checkpoint holds, as live references (the snapshot writer copies them)."""
    return {"model": model.state_dict(), "optimizer": _unwrapped(optimizer).state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True), "rank": rank,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                    "cpu": torch.random.get_rng_state()}}


def materialize(payload: dict[str, Any], step: int, where: Path, rank: int, world: int,
                round_no: str) -> str:
    """Write `payload` as the Trainer's `checkpoint-<step>/` under `where`; returns its path. Raises
    OSError (a full tmpfs: the caller falls back to the disk checkpoint)."""
    shutil.rmtree(where, ignore_errors=True)
    ckpt = where / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    ckpt.mkdir(parents=True)
    safetensors.torch.save_file(payload["model"], str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    torch.save(payload["optimizer"], ckpt / "optimizer.pt")
    if payload["scheduler"] is not None:
        torch.save(payload["scheduler"], ckpt / "scheduler.pt")
    (ckpt / "trainer_state.json").write_text(payload["trainer_state"])
    if world == 1 or payload["rank"] == rank:
        torch.save(payload["rng"], ckpt / ("rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"))
    atomic_write(where / MARK, json.dumps({"round": round_no, "step": step, "path": str(ckpt)}))
    return str(ckpt)


class HFSnapshotMixin:
    """The callback's snapshot tier (mixed into `transformers.PetctlCallback`).

    `snapshots`: `SnapshotOptions`, or False to switch the tier off (`PETCTL_SNAPSHOTS=0` does it for a
    job); None: on under the agent, every step while that costs under 5 % of the step."""

    snapshots: SnapshotOptions | bool | None = None
    memory: FrameworkSnapshots | None = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Trainer.__init__ is done: the process group is up, train() (which reads the checkpoint) is not.
        self.memory = memory = FrameworkSnapshots.create(self.snapshots)
        taken = memory.resume(lambda: newest_on_disk(args.output_dir))
        where = resume_dir()
        if taken is None or where is None:
            if where is not None:
                shutil.rmtree(where, ignore_errors=True)  # no older round's checkpoint is ever taken
            return
        step, payload = taken
        try:
            path = materialize(payload, step, where, memory.comm.rank, memory.comm.world_size,
                               os.environ.get("PETCTL_ROUND", "0"))
        except OSError as e:
            memory.log.emit("snapshot.load_failed", step=step, error=f"writing the checkpoint: {e}")
            shutil.rmtree(where, ignore_errors=True)
            return
        memory.log.emit("snapshot.materialized", step=step, path=path)

    def wire_resume(self, trainer: Any, output_dir: str) -> None:
        """Make `trainer.train` resume from the checkpoint this round wrote from memory when the script asks
        for an older one (`resume_choice`): the one line is enough however the script finds its
        checkpoint. One `snapshot.resume_swapped` line when it does."""
        original = trainer.train
        memory = self.memory

        @functools.wraps(original)
        def train(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
            from_memory = memory_checkpoint()
            chosen = resume_choice(resume_from_checkpoint, from_memory, output_dir)
            if chosen != resume_from_checkpoint and memory is not None:
                memory.log.emit("snapshot.resume_swapped", asked=str(resume_from_checkpoint), path=chosen,
                                step=checkpoint_step(from_memory))
            return original(chosen, *args, **kwargs)

        trainer.train = train

    def snapshot_step(self, state: Any, kwargs: dict[str, Any]) -> None:
        """At `on_step_end`: snapshot the step just completed when one is due (local rank 0)."""
        memory = self.memory
        if memory is None or not memory.writing:
            return
        model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if model is None or optimizer is None:
            return
        memory.take(state.global_step, lambda: capture(state, model, optimizer, scheduler, memory.comm.rank),
                    _unwrapped(optimizer))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.memory is not None:
            self.memory.close()


# --- the Trainer's half of exactly-once data ----------------------------------------------------------------
# How the Trainer reads its data (transformers 5): `get_train_dataloader` builds a DataLoader over
# `_get_train_sampler()` (a RandomSampler of the whole dataset) and `accelerator.prepare` wraps its batch
# sampler in accelerate's `BatchSamplerShard`: rank r of W takes whole batches r, r + W, ... On resume the
# Trainer skips `global_step * gradient_accumulation_steps` batches of that per-rank loader, whose cut
# changed with the world (transformers#40245).
#
# What the callback changes, on this Trainer only, in `on_init_end` (`wire_data`):
# - `_get_train_sampler` returns a `StepStream` (data.py) over an `ElasticSampler` of
#   `per_device_train_batch_size * gradient_accumulation_steps` per rank and step, seeded with `data_seed`
#   (else `seed`), `dataloader_drop_last` as its `drop_last`;
# - `get_train_dataloader` makes accelerate's shard a passthrough (the stream already is this rank's
#   stride), as the Trainer does for its own rank-aware BatchRebalanceSampler, and checks that the loader
#   reads through the stream (ValueError otherwise: a custom loader, `dispatch_batches`);
# - `ignore_data_skip=True`: the stream starts at the cursor, so the Trainer's skip must not skip again.
# The cursor moves at `on_step_end` (optimizer steps only: accumulation's micro-batches do not move it) and
# is kept in `TrainerState.stateful_callbacks[DATA_KEY]`, which both the Trainer's `trainer_state.json` and
# the in-memory snapshot hold; `on_train_begin` loads it from the resumed state.
# The Trainer is found from `on_init_end` by walking up to the `Trainer.__init__` that calls it
# (`find_trainer`): a TrainerCallback is never handed its Trainer.

DATA_KEY = "petctl.ElasticSampler"  # the cursor's key in TrainerState.stateful_callbacks


def find_trainer(callback: Any) -> Any | None:
    """The Trainer whose callback handler holds `callback`, from the calling frames (None when none does:
    the hook was called by hand)."""
    frame = sys._getframe(1)
    while frame is not None:
        handler = getattr(frame.f_locals.get("self"), "callback_handler", None)
        if handler is not None and any(cb is callback for cb in getattr(handler, "callbacks", ())):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def data_refusal(args: Any) -> str | None:
    """Why this Trainer's data cannot be made exact, in one line (None: it can)."""
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in (None, "random"):
        return (f"PetctlCallback: train_sampling_strategy={strategy!r} keeps an order of its own, which "
                "petctl cannot continue exactly at a new world size: use the default ('random'), or "
                "PetctlCallback(data=False) to keep it (samples repeated or skipped after a world change)")
    accel = getattr(args, "accelerator_config", None)
    if getattr(accel, "dispatch_batches", None):
        return ("PetctlCallback: accelerator_config.dispatch_batches=True has rank 0 read every batch, which "
                "petctl's per-rank sampler cannot feed: leave it unset, or pass PetctlCallback(data=False)")
    return None


class HFDataMixin:
    """The callback's exactly-once data (mixed into `transformers.PetctlCallback`; see above)."""

    data: bool = True
    wired = False  # wire_data ran for this callback's Trainer
    stream: StepStream | None = None

    def wire_data(self, trainer: Any, args: Any) -> None:
        """Put the stream in place of the Trainer's sampler (above). Raises ValueError (one line) for a
        setup that cannot be exact (`data_refusal`)."""
        reason = data_refusal(args)
        if reason is not None:
            raise ValueError(reason)
        if args.max_steps is None or args.max_steps <= 0:
            warnings.warn(epoch_bounded_reason("the Trainer", f"num_train_epochs={args.num_train_epochs}"),
                          stacklevel=2)
        args.ignore_data_skip = True
        original = trainer.get_train_dataloader

        def get_train_dataloader() -> Any:
            loader = original()
            self.check_loader(loader)
            return loader

        trainer._get_train_sampler = functools.partial(self.train_sampler, trainer)
        trainer.get_train_dataloader = get_train_dataloader

    def train_sampler(self, trainer: Any, train_dataset: Any = None) -> StepStream | None:
        """The Trainer's `_get_train_sampler` (an instance attribute): the stream, or None for a dataset
        without a length, as the Trainer's own."""
        dataset = trainer.train_dataset if train_dataset is None else train_dataset
        if dataset is None or not has_length(dataset):
            self.stream = None
            return None
        args = trainer.args
        batch = getattr(trainer, "_train_batch_size", None) or args.train_batch_size
        self.stream = build_stream(dataset, batch, args.gradient_accumulation_steps, rank=args.process_index,
                                   world_size=args.world_size, shuffle=True,
                                   seed=args.data_seed if args.data_seed is not None else args.seed,
                                   drop_last=args.dataloader_drop_last)
        return self.stream

    def check_loader(self, loader: Any) -> None:
        """Make accelerate's shard of the prepared loader a passthrough; raises ValueError (one line) when
        the loader does not read through the stream. A dataset without a length is warned about, once."""
        if self.stream is None:
            warnings.warn("petctl: the Trainer's train dataset has no length (an IterableDataset), so petctl "
                          "cannot keep its data exact across world changes; a map-style dataset can be",
                          stacklevel=3)
            return
        shard = getattr(loader, "batch_sampler", None)
        inner = getattr(shard, "batch_sampler", None)
        if inner is not None and getattr(inner, "sampler", None) is self.stream:
            shard.num_processes, shard.process_index = 1, 0  # the stream is this rank's stride already
            return
        if getattr(shard, "sampler", None) is self.stream:  # one process: accelerate did not shard
            return
        raise ValueError("PetctlCallback: the Trainer's train loader does not read through petctl's sampler "
                         "(a get_train_dataloader of your own?); pass PetctlCallback(data=False) to keep it "
                         "(samples repeated or skipped after a world change)")

    def resume_data(self, state: Any) -> None:
        """At `on_train_begin` (the Trainer restored its state): the cursor of the resumed step."""
        if self.stream is None:
            return
        saved = (state.stateful_callbacks or {}).get(DATA_KEY)
        how = resume_cursor(self.stream, saved, state.global_step)
        report_data_resumed(self.stream, state.global_step, how)
        if how == "assumed":
            warnings.warn(f"petctl: the checkpoint of step {state.global_step} holds no data cursor (saved "
                          "without PetctlCallback); the data continues where that many steps at this world "
                          "size would be", stacklevel=2)

    def data_step_end(self, state: Any) -> None:
        """At `on_step_end` (one optimizer step done), before any save or snapshot: move the cursor and put
        it in the state the Trainer and the snapshot save."""
        if self.stream is None:
            return
        self.stream.step_done(state.global_step - 1)
        state.stateful_callbacks[DATA_KEY] = self.stream.state_dict()


# --- the Trainer callback -----------------------------------------------------------------------------------


__all__ = ["PetctlCallback", "last_checkpoint"]


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The checkpoint to resume from: the one the callback wrote from node memory for this round, when
    the in-memory snapshots were newer than the disk (call this after building the Trainer, as
    `train(resume_from_checkpoint=last_checkpoint(...))` does: the callback decides in `on_init_end`);
    else the newest `checkpoint-N` under `output_dir`, or None (a fresh start, or no directory yet:
    `get_last_checkpoint` itself raises when the directory does not exist)."""
    from_memory = memory_checkpoint()
    if from_memory is not None:
        return from_memory
    return get_last_checkpoint(str(output_dir)) if os.path.isdir(output_dir) else None


class PetctlCallback(ProtocolCallback, HFSnapshotMixin, HFDataMixin, TrainerCallback):
    """Reports steps and checkpoints to petctl's agent and saves at its save-now flag (see the module).

    check_every: steps between save-now checks (each is one tiny all-reduce); 0 turns the protocol off
    (steps are still reported; at a notice the agent then SIGTERMs the workers, as for any script).
    every: "auto" also sets `should_save` every durable interval Young/Daly picks for the measured save
        time (protocol.py, autointerval.py); None leaves periodic saves to `TrainingArguments`.
    data: True puts petctl's `ElasticSampler` in place of the Trainer's sampler (every sample once across
        world changes; the Trainer's `ignore_data_skip` becomes True); False leaves the Trainer's own.
    Raises ValueError (one line, from `Trainer(...)`) for a data setup that cannot be exact, or when the
    callback was not passed to the Trainer's constructor (`data` needs the Trainer before `train`).
    """

    def __init__(self, check_every: int = 1, every: str | None = None, data: bool = True) -> None:
        super().__init__(check_every, every)
        self.data = data
        self._step_ended: float | None = None  # monotonic: our latest on_step_end (a save's start)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = find_trainer(self)
        if trainer is None:
            if self.data:
                raise ValueError("PetctlCallback: no Trainer calls this callback; pass it in "
                                 "Trainer(callbacks=[...]), or PetctlCallback(data=False)")
        elif self.data:
            self.wire_data(trainer, args)
            self.wired = True
        super().on_init_end(args, state, control, **kwargs)  # the in-memory tier's exchange (above)
        if trainer is not None:
            self.wire_resume(trainer, args.output_dir)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer has loaded `resume_from_checkpoint` by now: global_step is the resumed step.
        if self.data and not self.wired:
            raise ValueError("PetctlCallback: added after the Trainer was built (add_callback), too late to "
                             "put petctl's sampler in place; pass it in Trainer(callbacks=[...]), or "
                             "PetctlCallback(data=False)")
        self.resume_data(state)
        self.start(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.data_step_end(state)  # the cursor moves before the step is snapshot or saved
        self.snapshot_step(state, kwargs)  # the in-memory tier (transformers.py), before the save-now check
        if self.protocol is None:
            return
        # global_step counts completed optimizer steps: checkpoint-<step> holds the state after them.
        action = self.protocol.step_end(state.global_step, epoch=_rounded(state.epoch))
        if action is not Action.NONE:
            control.should_save = True
        if action is Action.STOP:
            control.should_training_stop = True
        self._step_ended = time.monotonic()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer saves right after the step's callbacks (`_maybe_log_save_evaluate`), then calls this:
        # the time since our `on_step_end` is the save's (an evaluation at the same step counts in it, so
        # a notice's hand-off plans with a little more than the save, never less).
        if self.protocol is not None:
            where = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            ended, self._step_ended = self._step_ended, None
            self.protocol.saved(state.global_step, where,
                                seconds=time.monotonic() - ended if ended is not None else None)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
