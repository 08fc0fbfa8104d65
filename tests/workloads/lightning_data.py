"""A Lightning script as its docs show it (`fit(ckpt_path="last")` with `ModelCheckpoint(save_last=True)`,
`callbacks=[PetctlCallback()]`), with the sample ledger of tests/workloads/data_ledger.py.

`--steps N`, `--save-steps K` (ModelCheckpoint's periodic checkpoints), `--step-time S` (padding per
step), `accumulate_grad_batches=2` of loader batches of 2: each optimizer step reads 4 samples per rank.
"""

import argparse
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from petctl.elastic.integrations.lightning import PetctlCallback, checkpoint_dir, devices_per_node, num_nodes
from petctl.elastic.integrations.paths import output_dir
from tests.workloads.data_ledger import Indexed, SampleLedger
from tests.workloads.padding import pad


class Module(pl.LightningModule):
    def __init__(self, ledger: SampleLedger) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.ledger = ledger

    def training_step(self, batch, batch_idx):
        self.ledger.read(batch["idx"])
        return nn.functional.mse_loss(self.lin(batch["x"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LedgerCallback(pl.Callback):
    def __init__(self, ledger: SampleLedger, step_time: float) -> None:
        self.ledger, self.step_time = ledger, step_time
        self.last = None

    def on_train_start(self, trainer, pl_module):
        self.last = trainer.global_step
        self.ledger.write("resumed", start=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.last:  # an optimizer step ended (not an accumulated micro-batch)
            self.last = trainer.global_step
            self.ledger.step_end(trainer.global_step - 1)
            pad(self.step_time)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_step >= trainer.max_steps:
            self.ledger.write("done", step=trainer.global_step - 1)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.0)
    args = p.parse_args(argv)
    root = output_dir("lightning-data-out", "lightning")
    ledger = SampleLedger()
    periodic = ModelCheckpoint(dirpath=checkpoint_dir(root), every_n_train_steps=args.save_steps,
                               save_top_k=-1, save_last=True)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=devices_per_node(),
                         num_nodes=num_nodes(), strategy="ddp", default_root_dir=root, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                         callbacks=[LedgerCallback(ledger, args.step_time), periodic, PetctlCallback()])
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=2)
    trainer.fit(Module(ledger), loader, ckpt_path="last")


if __name__ == "__main__":
    main(sys.argv[1:])
