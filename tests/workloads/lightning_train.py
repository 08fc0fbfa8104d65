"""A PyTorch Lightning script as a user writes it, plus a step ledger for the tests.

A tiny transformer classifier built from a config dict, synthetic data, CPU DDP over gloo, Lightning's own
checkpoints (ModelCheckpoint every `--save-steps`, `last.ckpt`), resumed with `last_checkpoint`, and
`num_nodes` from the world size. `callbacks=[PetctlCallback()]` is petctl's one line; `--no-petctl`
leaves it out (the same script as a user would run it before).

The ledger (what a user sees, not petctl's events): rank 0 appends one JSON line per completed step to
`$LEDGER_DIR/ledger.jsonl`, `{"event": "step", "step": i, "round", "world", "node", "ts"}` with
i = global_step - 1 (0-based), `resumed` when training starts and `done` with a sample of the final
weights when it ends at `--steps`. `--step-time` pads each step (a slower model).
"""

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from petctl.elastic.integrations.lightning import (
    PetctlCallback,
    checkpoint_dir,
    devices_per_node,
    last_checkpoint,
    num_nodes,
)
from petctl.elastic.integrations.paths import output_dir

CONFIG = {"vocab": 64, "length": 16, "width": 32, "heads": 2, "layers": 2, "classes": 4}


class Classifier(pl.LightningModule):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(config["vocab"], config["width"])
        layer = nn.TransformerEncoderLayer(config["width"], config["heads"], 2 * config["width"],
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, config["layers"])
        self.head = nn.Linear(config["width"], config["classes"])

    def training_step(self, batch, batch_idx):
        ids, label = batch
        logits = self.head(self.encoder(self.embed(ids)).mean(dim=1))
        return nn.functional.cross_entropy(logits, label)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def dataset(size: int) -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab"], (size, CONFIG["length"]), generator=g)
    return torch.utils.data.TensorDataset(ids, ids[:, 0] % CONFIG["classes"])


class Ledger(pl.Callback):
    def __init__(self, steps: int, step_time: float) -> None:
        directory = os.environ.get("LEDGER_DIR")
        self.path = os.path.join(directory, "ledger.jsonl") if directory else None
        self.steps, self.step_time = steps, step_time

    def write(self, trainer, event: str, **fields) -> None:
        if self.path and trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"ts": time.time(), "event": event, "world": trainer.world_size,
                                    "round": int(os.environ.get("PETCTL_ROUND", "0")),
                                    "node": os.environ.get("PETCTL_NODE_ID", ""), **fields}) + "\n")

    def on_train_start(self, trainer, pl_module):
        self.write(trainer, "resumed", start=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.write(trainer, "step", step=trainer.global_step - 1)
        time.sleep(self.step_time)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_step >= self.steps:
            self.write(trainer, "done", step=trainer.global_step - 1,
                       weights=[round(float(v), 6) for v in pl_module.head.weight[0, :4].detach()])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--output-dir", default="lightning-out")
    p.add_argument("--no-petctl", action="store_true")
    args = p.parse_args()
    root = output_dir(args.output_dir, "lightning")
    periodic = ModelCheckpoint(dirpath=checkpoint_dir(root), every_n_train_steps=args.save_steps,
                               save_top_k=-1, save_last=True)
    callbacks = [Ledger(args.steps, args.step_time), periodic]
    callbacks += [] if args.no_petctl else [PetctlCallback()]
    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=devices_per_node(),
                         num_nodes=num_nodes(), strategy="ddp", default_root_dir=root, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(Classifier(CONFIG), torch.utils.data.DataLoader(dataset(4096), batch_size=8),
                ckpt_path=last_checkpoint(root))


if __name__ == "__main__":
    main()
