"""A PyTorch Lightning job under petctl: a tiny transformer from a config, synthetic data, CPU DDP.

The script is an ordinary Lightning script (it runs the same under `torchrun --nproc-per-node 2`);
petctl's part is one line, `callbacks=[PetctlCallback()]`, plus `devices`/`num_nodes` from the world size
and `last_checkpoint` to resume:

    petctl run_job --name pl --min 1 --max 3 --size 2 examples/lightning_ddp.py -- --steps 300
    petctl status pl                  # the step, goodput and lost steps, from the callback's reports
    petctl chaos pl --notice          # a spot notice: every rank saves last.ckpt at that step, 0 redone

Lightning checks `devices * num_nodes == WORLD_SIZE`, and petctl changes the world size between rounds:
a hard-coded `num_nodes=2` fails as soon as one node is lost. `num_nodes()` and `devices_per_node()`
read this round's. Checkpoints (ModelCheckpoint every `--save-steps`, and the callback's `last.ckpt`) go
to the job's checkpoint directory (`$PETCTL_CHECKPOINT_URL`, `file://` locally; `--output-dir` under plain
torchrun). `--no-petctl` leaves the callback out, to compare. Needs
`pip install -c constraints.txt -e '.[lightning]'`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

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
    """Token sequences -> one of `classes` labels: embedding, transformer encoder, mean pool, linear."""

    def __init__(self, config: dict[str, int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(config["vocab"], config["width"])
        layer = nn.TransformerEncoderLayer(config["width"], config["heads"], 2 * config["width"],
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, config["layers"])
        self.head = nn.Linear(config["width"], config["classes"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, label = batch
        logits = self.head(self.encoder(self.embed(ids)).mean(dim=1))
        return nn.functional.cross_entropy(logits, label)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def dataset(size: int) -> torch.utils.data.Dataset:
    """Synthetic: the label is the first token mod `classes` (learnable), the same on every run."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab"], (size, CONFIG["length"]), generator=generator)
    return torch.utils.data.TensorDataset(ids, ids[:, 0] % CONFIG["classes"])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    p.add_argument("--save-steps", type=int, default=20, help="ModelCheckpoint's periodic checkpoints")
    p.add_argument("--batch-size", type=int, default=8, help="per worker")
    p.add_argument("--output-dir", default="lightning-out", help="checkpoints when not run by petctl")
    p.add_argument("--no-petctl", action="store_true", help="leave PetctlCallback out (to compare)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, callbacks: Sequence[pl.Callback] = ()) -> pl.Trainer:
    """Train; `callbacks` are added to the Trainer's (the tests add a step ledger)."""
    args = parse_args(argv)
    root = output_dir(args.output_dir, "lightning")
    periodic = ModelCheckpoint(dirpath=checkpoint_dir(root), every_n_train_steps=args.save_steps,
                               save_top_k=-1, save_last=True)
    petctl = [] if args.no_petctl else [PetctlCallback()]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=devices_per_node(),
                         num_nodes=num_nodes(), strategy="ddp", default_root_dir=root, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[*callbacks, periodic, *petctl])
    loader = torch.utils.data.DataLoader(dataset(100_000), batch_size=args.batch_size)
    trainer.fit(Classifier(CONFIG), loader, ckpt_path=last_checkpoint(root))
    return trainer


if __name__ == "__main__":
    main()
