"""Lightning's half of the in-memory snapshot tier (`memory.py`).

What is kept, at each step end (`on_train_batch_end`, the moment `ModelCheckpoint` saves at): the
checkpoint dict `trainer.save_checkpoint` would write (model, optimizers, schedulers, loop progress,
callbacks' states, precision plugin), built by the Trainer's own checkpoint connector. Its hooks run as
for any save (`on_save_checkpoint` of the module and the callbacks); the petctl callback does not report
these as saves.

How a job resumes from it: Lightning reads `fit(ckpt_path=...)` through its strategy's `CheckpointIO`.
In `setup` (the process group is up, nothing loaded yet) the callback puts a `MemoryCheckpointIO` in
front of it; its first load takes part in the snapshot exchange against the step of the checkpoint asked
for and returns the snapshot's dict when memory is at least as new, the file's otherwise. A fit with
no `ckpt_path` (no checkpoint on disk yet) loads nothing, so the callback does the exchange at
`on_fit_start` instead and restores the dict through the same connector, before Lightning restores the
loops and optimizers from it: the job resumes from memory whether or not a file exists.
The checkpoint connector (`trainer._checkpoint_connector`) is Lightning's own internal object (2.x).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from petctl.elastic.integrations.memory import FrameworkSnapshots
from petctl.elastic.snapshots.tier import SnapshotOptions

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
