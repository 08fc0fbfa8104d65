"""The PyTorch Lightning integration: its callback and its half of the in-memory snapshot tier.

PyTorch Lightning under petctl: true status, and no step lost at a notice or planned change.

    from petctl.elastic.integrations.lightning import (PetctlCallback, devices_per_node, last_checkpoint,
                                                       num_nodes)

    trainer = pl.Trainer(devices=devices_per_node(), num_nodes=num_nodes(), strategy="ddp",
                         default_root_dir=out, callbacks=[PetctlCallback()])
    trainer.fit(model, data, ckpt_path=last_checkpoint(out))

What the callback does (`protocol.SaveNowProtocol` holds the framework-neutral half):
- every completed optimizer step is a `train.step` line, every checkpoint saved through it a
  `checkpoint.saved` line: `petctl status` shows the step, and goodput and lost steps are true;
- at petctl's save-now flag (spot notice, planned scale change) every rank agrees on the same step in one
  all-reduce, calls `trainer.save_checkpoint(<checkpoints>/last.ckpt)` (collective in Lightning) at that
  step boundary and sets `trainer.should_stop`: `fit` returns, the workers exit 0, and the next round
  resumes at the step after it. At a rebalance recommendation it saves and training goes on;
- under the agent, local rank 0 of each node keeps the newest step's checkpoint dict in node memory
  (`lightning.py`): a node lost without warning costs at most one step.

Lightning's own rule: `devices * num_nodes` must equal the world size, which petctl changes between
rounds, so a hard-coded `num_nodes=2` fails when the world shrinks (`ValueError: ... does not match the
world size (1)`). `num_nodes()` and `devices_per_node()` read it from torchrun's environment.
Works with `lightning.pytorch` and `pytorch_lightning` alike: the callback subclasses whichever the
script imported first.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

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

# --- Lightning's half of the in-memory tier -----------------------------------------------------------------
# Lightning's half of the in-memory snapshot tier (`memory.py`).
#
# What is kept, at each step end (the `on_train_batch_end` of the batch that stepped the optimizer, the
# moment `ModelCheckpoint` saves at; never a micro-batch that only accumulated, `optimizer_step_ended`): the
# checkpoint dict `trainer.save_checkpoint` would write (model, optimizers, schedulers, loop progress,
# callbacks' states, precision plugin), built by the Trainer's own checkpoint connector. Its hooks run as
# for any save (`on_save_checkpoint` of the module and the callbacks); the petctl callback does not report
# these as saves.
#
# How a job resumes from it: Lightning reads `fit(ckpt_path=...)` through its strategy's `CheckpointIO`.
# In `setup` (the process group is up, nothing loaded yet) the callback puts a `MemoryCheckpointIO` in
# front of it; its first load takes part in the snapshot exchange against the step of the checkpoint asked
# for and returns the snapshot's dict when memory is at least as new, the file's otherwise. A fit with
# no `ckpt_path` (no checkpoint on disk yet) loads nothing, so the callback does the exchange at
# `on_fit_start` instead and restores the dict through the same connector, before Lightning restores the
# loops and optimizers from it: the job resumes from memory whether or not a file exists.
# The checkpoint connector (`trainer._checkpoint_connector`) is Lightning's own internal object (2.x).


if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
    from lightning_fabric.plugins import CheckpointIO
else:
    try:
        from lightning.fabric.plugins import CheckpointIO
    except ImportError:  # only the standalone package is installed
        from lightning_fabric.plugins import CheckpointIO


def _global_step(path: Any) -> int | None:
    """The step of the checkpoint file at `path` (mapped, not read whole); None when unreadable."""
    try:
        return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False)["global_step"])
    except (OSError, KeyError, ValueError, RuntimeError, TypeError):
        return None


class MemoryCheckpointIO(CheckpointIO):
    """The strategy's `CheckpointIO`, whose first load may come from node memory (see the module)."""

    def __init__(self, inner: Any, memory: FrameworkSnapshots) -> None:
        self.inner, self.memory = inner, memory
        self.asked = False  # the exchange ran (it runs once per fit, on every rank)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if not self.asked:
            self.asked = True
            taken = self.memory.resume(lambda: _global_step(path))
            if taken is not None:
                return taken[1]
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


class LightningSnapshotMixin:
    """The callback's snapshot tier (mixed into `lightning.PetctlCallback`).

    `snapshots`: `SnapshotOptions`, or False to switch the tier off (`PETCTL_SNAPSHOTS=0` does it for a
    job); None: on under the agent, every step while that costs under 5 % of the step."""

    snapshots: SnapshotOptions | bool | None = None
    memory: FrameworkSnapshots | None = None
    memory_io: MemoryCheckpointIO | None = None
    capturing = False  # a snapshot's dump is running: its on_save_checkpoint is no save

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.memory_io is not None:
            return
        self.memory = FrameworkSnapshots.create(self.snapshots)
        self.memory_io = MemoryCheckpointIO(trainer.strategy.checkpoint_io, self.memory)
        trainer.strategy.checkpoint_io = self.memory_io

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        io = self.memory_io
        if io is None or io.asked:
            return
        io.asked = True  # fit without ckpt_path: nothing was loaded, memory may still hold a step
        taken = io.memory.resume(lambda: None)
        if taken is None:
            return
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = taken[1]  # restore_training_state (next) reads loops and optimizers
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()

    def snapshot_step(self, trainer: Any) -> None:
        """At `on_train_batch_end`: snapshot the step just completed when one is due (local rank 0)."""
        memory = self.memory
        if memory is None or not memory.writing:
            return
        memory.take(trainer.global_step, lambda: self._dump(trainer))

    def _dump(self, trainer: Any) -> dict[str, Any]:
        self.capturing = True
        try:
            return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self.capturing = False

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.memory is not None:
            self.memory.close()
            if self.memory_io is not None and trainer.strategy.checkpoint_io is self.memory_io:
                trainer.strategy.checkpoint_io = self.memory_io.inner
            self.memory = self.memory_io = None


# --- Lightning's half of exactly-once data ------------------------------------------------------------------
# How Lightning reads its data (2.x): `fit_loop.setup_data` hands the train loader to the data connector's
# `_prepare_dataloader`, which, under DDP with `use_distributed_sampler` (the default), rebuilds it
# (`_update_dataloader`) around a shuffled `DistributedSampler(rank, world_size)`: a per-rank cut of the
# epoch. On a mid-epoch resume Lightning restores its loop counters but starts the loader at the epoch's
# start (unless the loader is stateful): samples read again.
#
# What the callback changes, on this Trainer only, in `setup` (`wire_data`): the connector's
# `_prepare_dataloader` rebuilds the train loader around a `StepStream` (data.py) instead: an
# `ElasticSampler` of `batch_size * accumulate_grad_batches` per rank and step, shuffled and seeded as
# Lightning's own (`PL_GLOBAL_SEED`, else 0), the loader's `drop_last`. It is built after Lightning restored
# the checkpoint, so the cursor the callback's `state_dict` saved (in every checkpoint Lightning writes and
# in the in-memory snapshot's dump) is loaded at once. The cursor moves at `on_train_batch_end` once per
# optimizer step (`global_step` changed), never per accumulated micro-batch.
# Refused in one line (ValueError from `fit`): a sampler or batch sampler of the user's own (its order cannot
# be continued at another world size), `limit_train_batches` (a cut epoch may end inside an accumulation).
# Warned, and left as it is: `use_distributed_sampler=False` (the script shards its data itself) and an
# IterableDataset.


def _lightning(name: str) -> Any:
    """`name` from whichever Lightning package the script imported (as the callback's base class)."""
    import importlib

    standalone = "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules
    base = "pytorch_lightning" if standalone else "lightning.pytorch"
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(f"{base}.{module}"), attr)


def data_refusal(loader: Any, limit_train_batches: Any) -> str | None:
    """Why this train loader cannot be read exactly, in one line (None: it can)."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    if limit_train_batches not in (None, 1.0) or isinstance(limit_train_batches, int):
        return (f"PetctlCallback: limit_train_batches={limit_train_batches!r} cuts Lightning's epoch where "
                "petctl's cursor does not; leave it unset, or pass PetctlCallback(data=False)")
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return ("PetctlCallback: the train loader has a batch sampler of its own, whose order petctl cannot "
                "continue at another world size; use batch_size=..., or pass PetctlCallback(data=False)")
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler, StepStream)):
        return (f"PetctlCallback: the train loader's sampler ({type(loader.sampler).__name__}) has an order "
                "of its own, which petctl cannot continue at another world size; use shuffle=True/False, or "
                "pass PetctlCallback(data=False)")
    return None


class LightningDataMixin:
    """The callback's exactly-once data (mixed into `lightning.PetctlCallback`; see above)."""

    data: bool = True
    stream: StepStream | None = None
    saved_data: dict[str, Any] | None = None  # the cursor Lightning restored, until the stream exists
    _original_prepare: Any = None

    def wire_data(self, trainer: Any) -> None:
        """Route the train loader through `elastic_loader` (at `setup`, before `fit` builds it)."""
        connector = trainer._data_connector
        self._original_prepare = original = connector._prepare_dataloader
        training = _lightning("trainer.states.RunningStage").TRAINING

        def prepare(dataloader: Any, shuffle: bool = True, mode: Any = None) -> Any:
            if mode == training and isinstance(dataloader, DataLoader):
                replaced = self.elastic_loader(trainer, dataloader)
                if replaced is not None:
                    return replaced
            return original(dataloader, shuffle=shuffle, mode=mode)

        connector._prepare_dataloader = prepare
        if trainer.max_steps is None or trainer.max_steps < 0:
            warnings.warn(epoch_bounded_reason("Lightning", f"max_epochs={trainer.max_epochs}"), stacklevel=2)

    def unwire_data(self, trainer: Any) -> None:
        if self._original_prepare is not None:
            vars(trainer._data_connector).pop("_prepare_dataloader", None)
            self._original_prepare = None
        self.stream = None

    def elastic_loader(self, trainer: Any, loader: Any) -> Any | None:
        """The train loader rebuilt around the stream; None leaves it to Lightning (warned). Raises
        ValueError (one line) for a loader that cannot be read exactly (`data_refusal`)."""
        from torch.utils.data import IterableDataset

        if not trainer._accelerator_connector.use_distributed_sampler:
            warnings.warn("petctl: use_distributed_sampler=False: the script shards its data itself, so "
                          "petctl cannot keep it exact across world changes", stacklevel=2)
            return None
        if isinstance(loader.dataset, IterableDataset):
            warnings.warn("petctl: the train loader reads an IterableDataset, which petctl cannot keep exact "
                          "across world changes; a map-style dataset can be", stacklevel=2)
            return None
        reason = data_refusal(loader, trainer.limit_train_batches)
        if reason is not None:
            raise ValueError(reason)
        if self.stream is None or self.stream.sampler.size != len(loader.dataset):
            self.stream = build_stream(loader.dataset, loader.batch_size, trainer.accumulate_grad_batches,
                                       rank=trainer.global_rank, world_size=trainer.world_size, shuffle=True,
                                       seed=int(os.environ.get("PL_GLOBAL_SEED", "0") or 0),
                                       drop_last=loader.drop_last)
            how = resume_cursor(self.stream, self.saved_data, trainer.global_step)
            report_data_resumed(self.stream, trainer.global_step, how)
        update = _lightning("utilities.data._update_dataloader")
        return update(loader, self.stream, mode=_lightning("trainer.states.RunningStage").TRAINING)

    def data_step_end(self, trainer: Any) -> None:
        """At `on_train_batch_end`, before any save or snapshot: the cursor moves once per optimizer step
        (`step_done` ignores the micro-batches that repeat the step)."""
        if self.stream is not None and trainer.global_step > 0:
            self.stream.step_done(trainer.global_step - 1)

    def state_dict(self) -> dict[str, Any]:
        """The cursor, in every checkpoint Lightning writes (and the in-memory snapshot's dump)."""
        if self.stream is not None:
            return {"data": self.stream.state_dict()}
        return {"data": self.saved_data} if self.saved_data is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_data = state_dict.get("data")
        if self.stream is not None and self.saved_data is not None:
            self.stream.load_state_dict(self.saved_data)


# --- the Lightning callback ---------------------------------------------------------------------------------


if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
    from pytorch_lightning import Callback
else:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # only the standalone package is installed
        from pytorch_lightning import Callback

__all__ = ["LAST", "PetctlCallback", "devices_per_node", "last_checkpoint", "num_nodes"]

LAST = "last.ckpt"  # the name Lightning's ModelCheckpoint(save_last=True) uses too


def checkpoint_dir(root: str | os.PathLike[str]) -> Path:
    """Where a Trainer with `default_root_dir=root` and no logger keeps its checkpoints."""
    return Path(root) / "checkpoints"


def last_checkpoint(root: str | os.PathLike[str] | None = None, *,
                    dirpath: str | os.PathLike[str] | None = None) -> str | None:
    """The checkpoint to resume from: `last.ckpt` in `dirpath` (default `<root>/checkpoints`, where the
    callback saves for a Trainer with `default_root_dir=root`) when it exists, else the newest `*.ckpt`
    there by modification time, else None (a fresh start). Raises ValueError when given neither."""
    if dirpath is None and root is None:
        raise ValueError("last_checkpoint needs the Trainer's default_root_dir or the checkpoints' dirpath")
    directory = Path(dirpath) if dirpath is not None else checkpoint_dir(root)  # type: ignore[arg-type]
    last = directory / LAST
    if last.is_file():
        return str(last)
    found = sorted(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    return str(found[-1]) if found else None


def optimizer_step_ended(global_step: int, seen: int | None) -> bool:
    """Whether the batch whose `on_train_batch_end` sees `global_step` stepped the optimizer: `seen` is the
    `global_step` of the previous step end this fit saw (the resumed step at `on_train_start`; None: training
    has not started, so no step has ended).

    Why: Lightning calls `on_train_batch_end` after every batch, and with `accumulate_grad_batches=N` only
    every N-th steps the optimizer (`global_step` moves then); the others leave gradients half accumulated.
    A snapshot or save there records a step that is half done (the gradients are not in the checkpoint) and
    an odd batch count of Lightning's epoch: resumed from it, Lightning steps its optimizer after the first
    micro-batch, and every later step of that epoch reads half of one step of the stream and half of the
    next, behind the cursor, whose samples at the epoch's end are never read. So the callback reports,
    snapshots and saves at step ends only (the save-now all-reduce runs there too, the same batch on every
    rank, since every rank steps together)."""
    return seen is not None and global_step != seen


class PetctlCallback(ProtocolCallback, LightningSnapshotMixin, LightningDataMixin, Callback):
    """Reports steps and checkpoints to petctl's agent and saves at its save-now flag (see the module).

    check_every: steps between save-now checks (each is one tiny all-reduce); 0 turns the protocol off.
    dirpath: where the save-now checkpoint goes, as `last.ckpt`. Default: the script's own
        `ModelCheckpoint(dirpath=...)`, where a script resumes from (`ckpt_path="last"` finds it there,
        as does `last_checkpoint(dirpath=...)`); without one, `<default_root_dir>/checkpoints`, which
        `last_checkpoint(default_root_dir)` reads (not Lightning's own choice with a logger: a new
        `version_N/` in every round). Under petctl a directory inside the worker's working directory is
        refused at start (`setup` raises ValueError): each instance has its own, so a replacement would
        never see the save and redo the steps.
    every: "auto" also saves `last.ckpt` every durable interval Young/Daly picks for the measured save
        time (protocol.py, autointerval.py); None leaves periodic saves to the user's ModelCheckpoint.
    data: True puts petctl's `ElasticSampler` in place of Lightning's DistributedSampler for the train
        loader (every sample once across world changes); False leaves Lightning's own. `fit` raises
        ValueError (one line) for a train loader that cannot be read exactly (`data_refusal`).
    """

    def __init__(self, check_every: int = 1, dirpath: str | os.PathLike[str] | None = None,
                 every: str | None = None, data: bool = True) -> None:
        super().__init__(check_every, every)
        self.dirpath = dirpath
        self.data = data
        self._reported_step: int | None = None  # the last step a checkpoint.saved line was written for
        self._dumped: tuple[int, float] | None = None  # a save under way: (its step, monotonic start)
        self._step_seen: int | None = None  # global_step at the last step end (optimizer_step_ended)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # the in-memory tier's checkpoint IO (lightning.py)
        # Lightning runs checkpoint callbacks' hooks last: their dirpath is still the script's (or None).
        if self.dirpath is None:
            self.dirpath = next((cb.dirpath for cb in getattr(trainer, "checkpoint_callbacks", [])
                                 if getattr(cb, "dirpath", None)), None)
        check_shared(self.base(trainer))
        if stage == "fit" and self.data and self._original_prepare is None:
            self.wire_data(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)  # the in-memory tier
        if stage == "fit":
            self.unwire_data(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning has restored `ckpt_path` by now: global_step is the resumed step.
        self._step_seen = trainer.global_step
        self.start(trainer.global_step)

    def base(self, trainer: Any) -> Path:
        """The save-now checkpoint's directory (the same on every rank)."""
        return Path(self.dirpath) if self.dirpath is not None else checkpoint_dir(trainer.default_root_dir)

    def path(self, trainer: Any) -> str:
        """The save-now checkpoint's path (the same on every rank)."""
        return str(self.base(trainer) / LAST)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # completed optimizer steps, as the checkpoint will record
        if not optimizer_step_ended(step, self._step_seen):
            return  # a micro-batch that only accumulated: no step to report, snapshot or save
        self._step_seen = step
        self.data_step_end(trainer)  # the cursor moves before the step is snapshot or saved
        self.snapshot_step(trainer)  # the in-memory tier (lightning.py), before the save-now check
        if self.protocol is None:
            return
        action = self.protocol.step_end(step, epoch=trainer.current_epoch)
        if action is Action.NONE:
            return
        path = self.path(trainer)
        began = time.monotonic()
        trainer.save_checkpoint(path)  # collective: every rank calls it at this step
        self.protocol.saved(step, path, seconds=time.monotonic() - began)
        self._reported_step = step  # a ModelCheckpoint save at this step is the same state: not again
        if action is Action.STOP:
            trainer.should_stop = True

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Every save goes through here (ModelCheckpoint's too); ours is reported by `saved` above. One
        # line per step: ModelCheckpoint(save_last=True) saves a step twice (its file and last.ckpt).
        if self.capturing:  # an in-memory snapshot's dump, not a save
            return
        # The file is written after this hook returns: the line waits for the next batch (or the end),
        # so it says the save is done and how long it took, which a spot notice's hand-off plans with.
        step = trainer.global_step
        if (self.protocol is not None and self.protocol.pending is Action.NONE and trainer.global_rank == 0
                and step != self._reported_step):
            self._reported_step = step
            self._dumped = (step, time.monotonic())

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._report_dumped()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._report_dumped()

    def _report_dumped(self) -> None:
        """The `checkpoint.saved` line of a save (ModelCheckpoint's) that has finished writing since."""
        if self._dumped is not None and self.protocol is not None:
            (step, began), self._dumped = self._dumped, None
            self.protocol.events.emit("checkpoint.saved", step=step, reason="periodic",
                                      seconds=round(time.monotonic() - began, 3))


def check_shared(directory: Path, environ: dict[str, str] | None = None) -> None:
    """Under petctl, refuse a checkpoint directory inside the worker's working directory, in one line:
    each instance has its own, so a replacement instance would never see what was saved there."""
    env = os.environ if environ is None else environ
    if not env.get("PETCTL_NODE_ID"):
        return  # plain torchrun: every rank shares the working directory
    cwd, where = Path.cwd().resolve(), directory.resolve()
    if where == cwd or cwd in where.parents:
        raise ValueError(
            f"petctl: Lightning checkpoints would go to {where}, inside this instance's own working "
            "directory, which a replacement instance never sees: give ModelCheckpoint(dirpath=...) or "
            "Trainer(default_root_dir=...) a directory every node shares, such as "
            "petctl.elastic.integrations.paths.output_dir(...) ($PETCTL_CHECKPOINT_URL's directory)")


# --- how many nodes and devices this round has --------------------------------------------------------------
# How many nodes this round has, for frameworks that must be told (Lightning's `num_nodes`).
#
# petctl changes the world size between rounds (a node lost, one added), and starts every round's workers
# with torchrun's environment: `WORLD_SIZE` (all workers) and `LOCAL_WORLD_SIZE` (workers on this node).
# A script that hard-codes `num_nodes=2` works until the world shrinks, then fails in every worker:
# Lightning checks `devices * num_nodes == WORLD_SIZE`.


def devices_per_node(environ: Mapping[str, str] | None = None) -> int:
    """Workers on this node (`LOCAL_WORLD_SIZE`, petctl's `--nproc-per-node`; 1 outside torchrun): the
    Trainer's `devices`. Raises ValueError, in one line, when the variable is not a positive integer."""
    value = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {value!r}")
    return int(value)


def num_nodes(devices: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """This round's node count: WORLD_SIZE / devices per node (default LOCAL_WORLD_SIZE, else 1).

    Raises ValueError, in one line, when the environment is malformed or the world size is not a
    multiple of `devices` (the Trainer's `devices` must be the agent's `--nproc-per-node`)."""
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        per_node = int(devices if devices is not None else env.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"WORLD_SIZE/LOCAL_WORLD_SIZE must be integers: {e}") from None
    if per_node < 1 or world < 1 or world % per_node:
        raise ValueError(f"world size {world} is not a whole number of nodes of {per_node} device(s) each: "
                         "the Trainer's devices must equal petctl's --nproc-per-node")
    return world // per_node
