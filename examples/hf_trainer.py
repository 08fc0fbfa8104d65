"""A Hugging Face `Trainer` job under petctl: a tiny GPT-2 from a config, synthetic tokens, CPU DDP.

The script is an ordinary Trainer script (it runs the same under `torchrun --nproc-per-node 2`); petctl's
part is one line, `callbacks=[PetctlCallback()]`, and `last_checkpoint` to resume:

    petctl run_job --name hf --min 1 --max 3 --size 2 examples/hf_trainer.py -- --steps 300
    petctl status hf                  # the step, goodput and lost steps, from the callback's reports
    petctl chaos hf --notice          # a spot notice: every rank saves checkpoint-<step>, 0 steps redone

The Trainer writes its own checkpoints (`checkpoint-N/`, every `--save-steps`) to the job's checkpoint
directory (`$PETCTL_CHECKPOINT_URL`, a `file://` directory every local "instance" shares; `--output-dir`
under plain torchrun). `--no-petctl` leaves the callback out, to see the difference: at a notice the
workers then get SIGTERM and redo the steps since the last periodic checkpoint. Needs
`pip install -c constraints.txt -e '.[transformers]'`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from petctl.elastic.integrations.paths import output_dir
from petctl.elastic.integrations.transformers import PetctlCallback, last_checkpoint

CONFIG = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same for an index on every run (a resumed run sees the same data)."""

    def __init__(self, size: int, length: int, vocab: int) -> None:
        self.size, self.length, self.vocab = size, length, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    p.add_argument("--save-steps", type=int, default=20, help="the Trainer's periodic checkpoints")
    p.add_argument("--batch-size", type=int, default=4, help="per worker")
    p.add_argument("--output-dir", default="hf-out", help="checkpoints when not run by petctl")
    p.add_argument("--no-petctl", action="store_true", help="leave PetctlCallback out (to compare)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, callbacks: Sequence[TrainerCallback] = ()) -> Trainer:
    """Train; `callbacks` are added to the Trainer's (the tests add a step ledger)."""
    args = parse_args(argv)
    out = output_dir(args.output_dir, "hf")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    training = TrainingArguments(output_dir=out, max_steps=args.steps,
                                 per_device_train_batch_size=args.batch_size, save_steps=args.save_steps,
                                 save_total_limit=2, logging_steps=10**6, report_to=[], use_cpu=True,
                                 ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True, seed=0)
    petctl = [] if args.no_petctl else [PetctlCallback()]
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(100_000, 16, CONFIG.vocab_size),
                      callbacks=[*callbacks, *petctl])
    trainer.train(resume_from_checkpoint=last_checkpoint(out))
    return trainer


if __name__ == "__main__":
    main()
