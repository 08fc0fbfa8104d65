"""Issue 45, the framework callbacks' data tier in pieces, in one process: the step stream the callbacks
give a framework, the rules that pick the checkpoint a Trainer resumes from and refuse what cannot be
exact, and a Trainer and a Lightning fit with gradient accumulation resumed mid-epoch from their own
checkpoints. The multi-node runs are tests/e2e/test_framework_data_exactly_once.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from petctl.elastic.integrations.data import StepStream, build_stream, nominal_steps, resume_cursor

pytest.importorskip("transformers")
pytest.importorskip("lightning")


def _streams(size: int, world: int, batch: int = 2, accumulation: int = 2) -> list[StepStream]:
    return [build_stream(range(size), batch, accumulation, rank=r, world_size=world, shuffle=True, seed=3,
                         drop_last=False) for r in range(world)]


def _read(streams: list[StepStream], steps: int, first: int = 0) -> list[int]:
    """`steps` steps of every rank from the cursor, in global position order; each step marked done."""
    world, per_rank = len(streams), streams[0].plan.per_rank
    iters = [iter(s) for s in streams]
    out: list[int] = []
    for step in range(first, first + steps):
        ranks = [list(itertools.islice(it, per_rank)) for it in iters]
        out += [ranks[p % world][p // world] for p in range(per_rank * world)]
        for s in streams:
            s.step_done(step)
    return out


def test_the_stream_runs_across_epochs_and_a_new_world_continues_at_the_cursor():
    size = 41
    two = _streams(size, 2)
    assert len(two[0]) == nominal_steps(8, size, False) * 4 == 6 * 4  # one whole epoch, whole steps
    seen = _read(two, 7)  # 56 samples: past the first epoch's end
    three = _streams(size, 3)
    for s in three:
        s.load_state_dict(two[0].state_dict())
    seen += _read(three, 5, first=7)  # 60 more: a world change mid-epoch 1
    epochs = [seen[i:i + size] for i in range(0, len(seen), size)]
    assert all(sorted(e) == list(range(size)) for e in epochs[:2])
    assert len(set(epochs[2])) == len(epochs[2])


def test_the_cursor_moves_once_per_step_and_an_old_iterator_is_refused():
    (stream,) = _streams(10, 1)
    it = iter(stream)
    next(it)
    for _ in range(3):
        stream.step_done(0)  # the micro-batches of one step: one move
    assert stream.state_dict()["offset"] == 4
    stream.load_state_dict(stream.state_dict())
    with pytest.raises(RuntimeError, match="before the cursor was loaded"):
        list(itertools.islice(it, 10))


def test_resume_cursor_saved_fresh_or_assumed():
    (a,), (b,) = _streams(41, 1), _streams(41, 1)
    _read([a], 3)
    assert resume_cursor(b, a.state_dict(), 3) == "saved" and b.state_dict() == a.state_dict()
    (c,) = _streams(41, 1)
    assert resume_cursor(c, None, 0) == "fresh" and c.state_dict()["offset"] == 0
    assert resume_cursor(c, None, 3) == "assumed" and c.state_dict()["offset"] == a.state_dict()["offset"]
    (other,) = [build_stream(range(40), 2, 2, rank=0, world_size=1, shuffle=True, seed=3, drop_last=False)]
    with pytest.raises(ValueError, match="another dataset|different dataset"):
        resume_cursor(other, a.state_dict(), 3)


def test_resume_choice_takes_memory_over_an_older_checkpoint_of_the_output_dir(tmp_path: Path):
    from petctl.elastic.integrations.transformers import resume_choice

    out = str(tmp_path / "out")
    mem = "/dev/shm/snap/hf-resume-0/checkpoint-15"
    assert resume_choice(f"{out}/checkpoint-10", mem, out) == mem  # get_last_checkpoint, before or after
    assert resume_choice(True, mem, out) == mem and resume_choice(None, mem, out) == mem
    assert resume_choice(f"{out}/checkpoint-20", mem, out) == f"{out}/checkpoint-20"  # newer: the script's
    assert resume_choice("/elsewhere/checkpoint-3", mem, out) == "/elsewhere/checkpoint-3"
    assert resume_choice(f"{out}/checkpoint-10", None, out) == f"{out}/checkpoint-10"


class _Tiny(nn.Module):
    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.seen = nn.Linear(4, 1), seen

    def forward(self, x, labels, idx):
        self.seen.extend(idx.tolist())
        out = self.lin(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _data(n: int = 21) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.full((4,), float(i)), "labels": torch.ones(1), "idx": torch.tensor(i)}
            for i in range(n)]


def test_the_trainer_refuses_an_order_of_its_own_in_one_line(tmp_path: Path):
    from transformers import Trainer, TrainingArguments

    from petctl.elastic.integrations.transformers import PetctlCallback

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, use_cpu=True, report_to=[],
                             train_sampling_strategy="group_by_length")
    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length'"):
        Trainer(model=_Tiny([]), args=args, train_dataset=_data(), callbacks=[PetctlCallback()])


def test_a_trainer_with_accumulation_resumed_mid_epoch_reads_each_sample_once(tmp_path: Path):
    """Stopped after step 3 (checkpoint-3, 12 of an epoch's 21 samples), resumed by a script that finds
    the checkpoint with `get_last_checkpoint` before building the Trainer: steps 4-8 read on from sample 12,
    into the next epoch, as one run would."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from petctl.elastic.integrations.transformers import PetctlCallback

    class StopAt(TrainerCallback):
        def __init__(self, step: int | None) -> None:
            self.step = step

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.step:
                control.should_save = control.should_training_stop = True

    def run(out: Path, stop: int | None) -> list[int]:
        seen: list[int] = []
        last = get_last_checkpoint(str(out)) if out.is_dir() else None
        args = TrainingArguments(output_dir=str(out), max_steps=8, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, use_cpu=True, save_steps=100, report_to=[],
                                 disable_tqdm=True, logging_steps=100)
        trainer = Trainer(model=_Tiny(seen), args=args, train_dataset=_data(),
                          callbacks=[PetctlCallback(), StopAt(stop)])
        trainer.train(resume_from_checkpoint=last)
        return seen

    whole = run(tmp_path / "whole", None)
    assert sorted(whole[:21]) == list(range(21)) and len(set(whole[21:])) == len(whole[21:]) == 11
    out = tmp_path / "cut"
    first = run(out, 3)
    assert first == whole[:12]
    assert run(out, None) == whole[12:]


def test_lightning_with_accumulation_resumed_mid_epoch_reads_each_sample_once(tmp_path: Path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from petctl.elastic.integrations.lightning import PetctlCallback

    class Module(pl.LightningModule):
        def __init__(self, seen: list[int]) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.seen = nn.Linear(4, 1), seen

        def training_step(self, batch, batch_idx):
            self.seen.extend(batch["idx"].tolist())
            return nn.functional.mse_loss(self.lin(batch["x"]), batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(root: Path, steps: int) -> list[int]:
        seen: list[int] = []
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, default_root_dir=str(root),
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             accumulate_grad_batches=2,
                             callbacks=[ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1),
                                        PetctlCallback()])
        loader = torch.utils.data.DataLoader(_data(), batch_size=2)
        trainer.fit(Module(seen), loader, ckpt_path="last")
        return seen

    whole = fit(tmp_path / "whole", 8)
    assert sorted(whole[:21]) == list(range(21)) and len(set(whole[21:])) == len(whole[21:]) == 11
    first = fit(tmp_path / "cut", 3)
    assert first == whole[:12]
    assert fit(tmp_path / "cut", 8) == whole[12:]


def test_lightning_refuses_a_sampler_of_its_own_in_one_line(tmp_path: Path):
    import lightning.pytorch as pl

    from petctl.elastic.integrations.lightning import PetctlCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.lin(batch["x"]), batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = _data()
    loader = torch.utils.data.DataLoader(
        data, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler([1.0] * len(data), len(data)))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, default_root_dir=str(tmp_path),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[PetctlCallback()])
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        trainer.fit(Module(), loader)
