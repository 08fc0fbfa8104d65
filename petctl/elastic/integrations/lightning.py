"""PyTorch Lightning under petctl: true status, and no step lost at a notice or planned change.

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
  (`plmemory.py`): a node lost without warning costs at most one step.

Lightning's own rule: `devices * num_nodes` must equal the world size, which petctl changes between
rounds, so a hard-coded `num_nodes=2` fails when the world shrinks (`ValueError: ... does not match the
world size (1)`). `num_nodes()` and `devices_per_node()` read it from torchrun's environment.
Works with `lightning.pytorch` and `pytorch_lightning` alike: the callback subclasses whichever the
script imported first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from petctl.elastic.integrations.plmemory import LightningSnapshotMixin
from petctl.elastic.integrations.protocol import Action, ProtocolCallback
from petctl.elastic.integrations.worldsize import devices_per_node, num_nodes

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


class PetctlCallback(ProtocolCallback, LightningSnapshotMixin, Callback):
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
    """

    def __init__(self, check_every: int = 1, dirpath: str | os.PathLike[str] | None = None,
                 every: str | None = None) -> None:
        super().__init__(check_every, every)
        self.dirpath = dirpath
        self._reported_step: int | None = None  # the last step a checkpoint.saved line was written for

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # the in-memory tier's checkpoint IO (plmemory.py)
        # Lightning runs checkpoint callbacks' hooks last: their dirpath is still the script's (or None).
        if self.dirpath is None:
            self.dirpath = next((cb.dirpath for cb in getattr(trainer, "checkpoint_callbacks", [])
                                 if getattr(cb, "dirpath", None)), None)
        check_shared(self.base(trainer))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning has restored `ckpt_path` by now: global_step is the resumed step.
        self.start(trainer.global_step)

    def base(self, trainer: Any) -> Path:
        """The save-now checkpoint's directory (the same on every rank)."""
        return Path(self.dirpath) if self.dirpath is not None else checkpoint_dir(trainer.default_root_dir)

    def path(self, trainer: Any) -> str:
        """The save-now checkpoint's path (the same on every rank)."""
        return str(self.base(trainer) / LAST)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.snapshot_step(trainer)  # the in-memory tier (plmemory.py), before the save-now check
        if self.protocol is None:
            return
        step = trainer.global_step  # completed optimizer steps, as the checkpoint will record
        action = self.protocol.step_end(step, epoch=trainer.current_epoch)
        if action is Action.NONE:
            return
        path = self.path(trainer)
        trainer.save_checkpoint(path)  # collective: every rank calls it at this step
        self.protocol.saved(step, path)
        self._reported_step = step  # a ModelCheckpoint save at this step is the same state: not again
        if action is Action.STOP:
            trainer.should_stop = True

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Every save goes through here (ModelCheckpoint's too); ours is reported by `saved` above. One
        # line per step: ModelCheckpoint(save_last=True) saves a step twice (its file and last.ckpt).
        if self.capturing:  # an in-memory snapshot's dump, not a save
            return
        step = trainer.global_step
        if (self.protocol is not None and self.protocol.pending is Action.NONE and trainer.global_rank == 0
                and step != self._reported_step):
            self._reported_step = step
            self.protocol.events.emit("checkpoint.saved", step=step, reason="periodic")


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
