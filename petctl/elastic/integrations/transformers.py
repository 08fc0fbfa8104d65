"""The Hugging Face `Trainer` integration: its callback and its half of the in-memory snapshot tier.

The Hugging Face `Trainer` under petctl: true status, and no step lost at a notice or planned change.

    from petctl.elastic.integrations.transformers import PetctlCallback, last_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[PetctlCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

What the callback does (`protocol.SaveNowProtocol` holds the framework-neutral half):
- every completed optimizer step is a `train.step` line, every checkpoint the Trainer writes a
  `checkpoint.saved` line: `petctl status` shows the step, and goodput and lost steps are true;
- at petctl's save-now flag (spot notice, planned scale change) every rank agrees on the same step in one
  all-reduce, and the callback sets `control.should_save` and `control.should_training_stop`: the Trainer
  writes `checkpoint-<step>` at that step boundary and leaves its loop, the workers exit 0, and the next
  round resumes at the step after it. At a rebalance recommendation it sets `should_save` only.
Its cost: one all-reduce of three integers per step (`check_every=1`; raise it for very short steps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from petctl.core.snapshotrecord import ENV_SNAPSHOT_DIR
from petctl.elastic.integrations.memory import FrameworkSnapshots
from petctl.elastic.integrations.protocol import Action, ProtocolCallback
from petctl.elastic.snapshots import SnapshotOptions

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
# `last_checkpoint(output_dir)`, called after the Trainer is built, returns it. RNG: the rank that wrote the
# snapshot gets its generators back (`rng_state_<rank>.pth`); other ranks keep their own seeds, as the
# Trainer does for a rank its checkpoint has no RNG file for.


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
    tmp = where / (MARK + ".tmp")
    tmp.write_text(json.dumps({"round": round_no, "step": step, "path": str(ckpt)}))
    os.replace(tmp, where / MARK)
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


class PetctlCallback(ProtocolCallback, HFSnapshotMixin, TrainerCallback):
    """Reports steps and checkpoints to petctl's agent and saves at its save-now flag (see the module).

    check_every: steps between save-now checks (each is one tiny all-reduce); 0 turns the protocol off
    (steps are still reported; at a notice the agent then SIGTERMs the workers, as for any script).
    every: "auto" also sets `should_save` every durable interval Young/Daly picks for the measured save
        time (protocol.py, autointerval.py); None leaves periodic saves to `TrainingArguments`.
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer has loaded `resume_from_checkpoint` by now: global_step is the resumed step.
        self.start(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.snapshot_step(state, kwargs)  # the in-memory tier (transformers.py), before the save-now check
        if self.protocol is None:
            return
        # global_step counts completed optimizer steps: checkpoint-<step> holds the state after them.
        action = self.protocol.step_end(state.global_step, epoch=_rounded(state.epoch))
        if action is not Action.NONE:
            control.should_save = True
        if action is Action.STOP:
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.protocol is not None:
            where = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self.protocol.saved(state.global_step, where)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
