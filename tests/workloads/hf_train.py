"""A Hugging Face Trainer script as a user writes it, plus a step ledger for the tests.

A tiny GPT-2 built from a config, synthetic token data, CPU DDP over gloo, the Trainer's own checkpoints
(`checkpoint-N/` every `--save-steps`), resumed with `last_checkpoint`. `callbacks=[PetctlCallback()]` is
petctl's one line; `--no-petctl` leaves it out (the same script as a user would run it before).

The ledger (not petctl's events: what a user sees) is a callback of the script's own: rank 0 appends one
JSON line per completed step to `$LEDGER_DIR/ledger.jsonl`, `{"event": "step", "step": i, "round",
"world", "node", "ts"}` with i = global_step - 1 (0-based), `resumed` when training starts and `done` with
the final weights' sample when it ends at `--steps`. `--step-time` pads each step (a slower model).
"""

import argparse
import json
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from petctl.elastic.integrations.paths import output_dir
from petctl.elastic.integrations.transformers import PetctlCallback, last_checkpoint


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same for every index on every run."""

    def __init__(self, size: int, length: int, vocab: int) -> None:
        self.size, self.length, self.vocab = size, length, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class Ledger(TrainerCallback):
    def __init__(self, steps: int, step_time: float) -> None:
        directory = os.environ.get("LEDGER_DIR")
        self.path = os.path.join(directory, "ledger.jsonl") if directory else None
        self.steps, self.step_time = steps, step_time
        self.world = int(os.environ.get("WORLD_SIZE", "1"))

    def write(self, event: str, **fields) -> None:
        if self.path and int(os.environ.get("RANK", "0")) == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"ts": time.time(), "event": event, "world": self.world,
                                    "round": int(os.environ.get("PETCTL_ROUND", "0")),
                                    "node": os.environ.get("PETCTL_NODE_ID", ""), **fields}) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self.write("resumed", start=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.write("step", step=state.global_step - 1)
        time.sleep(self.step_time)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if state.global_step >= self.steps:
            self.write("done", step=state.global_step - 1,
                       weights=[round(float(v), 6) for v in model.lm_head.weight[0, :4].detach()])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--output-dir", default="hf-out")
    p.add_argument("--no-petctl", action="store_true")
    args = p.parse_args()
    out = output_dir(args.output_dir, "hf")
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
                              save_steps=args.save_steps, save_total_limit=2, logging_steps=10**6,
                              report_to=[], use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0,
                              disable_tqdm=True, seed=0)
    callbacks = [Ledger(args.steps, args.step_time)] + ([] if args.no_petctl else [PetctlCallback()])
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(4096, 16, 128), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=last_checkpoint(out))


if __name__ == "__main__":
    main()
