"""The Hugging Face `Trainer` under petctl: true status, and no step lost at a notice or planned change.

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

import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from petctl.elastic.integrations.hfmemory import HFSnapshotMixin, memory_checkpoint
from petctl.elastic.integrations.protocol import Action, ProtocolCallback

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
        self.snapshot_step(state, kwargs)  # the in-memory tier (hfmemory.py), before the save-now check
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
