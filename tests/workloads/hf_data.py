"""A Hugging Face Trainer script as its docs show it (`get_last_checkpoint(output_dir)` before the Trainer
is built, `callbacks=[PetctlCallback()]`), with the sample ledger of tests/workloads/data_ledger.py.

`--steps N`, `--save-steps K` (the Trainer's periodic checkpoints), `--step-time S` (padding per step),
gradient accumulation of 2 micro-batches of 2 per rank: each optimizer step reads 4 samples per rank.
"""

import argparse
import os
import sys

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from petctl.elastic.integrations.paths import output_dir
from petctl.elastic.integrations.transformers import PetctlCallback
from tests.workloads.data_ledger import Indexed, SampleLedger
from tests.workloads.padding import pad


class Tiny(nn.Module):
    def __init__(self, ledger: SampleLedger) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.ledger = ledger

    def forward(self, x, labels, idx):
        self.ledger.read(idx)
        out = self.lin(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class LedgerCallback(TrainerCallback):
    def __init__(self, ledger: SampleLedger, step_time: float) -> None:
        self.ledger, self.step_time = ledger, step_time

    def on_train_begin(self, args, state, control, **kwargs):
        self.ledger.write("resumed", start=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.ledger.step_end(state.global_step - 1)
        pad(self.step_time)

    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            self.ledger.write("done", step=state.global_step - 1)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.0)
    args = p.parse_args(argv)
    out = output_dir("hf-data-out", "hf")
    last = get_last_checkpoint(out) if os.path.isdir(out) else None  # as run_clm.py: before the Trainer
    ledger = SampleLedger()
    training = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, save_steps=args.save_steps,
                                 save_total_limit=2, logging_steps=10**6, report_to=[], use_cpu=True,
                                 ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True, seed=0,
                                 learning_rate=0.01)
    trainer = Trainer(model=Tiny(ledger), args=training, train_dataset=Indexed(),
                      callbacks=[LedgerCallback(ledger, args.step_time), PetctlCallback()])
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main(sys.argv[1:])
