"""Issue 45, the framework callbacks' data tier in pieces, in one process: the step stream the callbacks
give a framework, the rules that pick the checkpoint a Trainer resumes from and refuse what cannot be
exact, a Trainer and a Lightning fit with gradient accumulation resumed mid-epoch from their own
checkpoints, and a Lightning fit lost or noticed between a step's two micro-batches. The multi-node runs
are tests/e2e/test_framework_data_exactly_once.py."""

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


def test_a_step_ends_at_the_batch_that_moves_global_step():
    from petctl.elastic.integrations.lightning import optimizer_step_ended

    assert not optimizer_step_ended(5, None)  # training has not started
    assert not optimizer_step_ended(3, 3)  # resumed at 3, the first micro-batch only accumulated
    assert optimizer_step_ended(4, 3) and optimizer_step_ended(6, 4)  # manual optimization may step twice


def _lightning_module(seen: list[int], fail_at: int | None = None):
    """The module of the Lightning tests below: it notes the indices of every micro-batch, and raises at
    training_step call `fail_at` (0-based), as a node lost mid-step makes the survivors' next collective
    raise."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.calls = nn.Linear(4, 1), 0

        def training_step(self, batch, batch_idx):
            if self.calls == fail_at:
                raise RuntimeError("a peer is gone (the survivors' all-reduce fails)")
            self.calls += 1
            seen.extend(batch["idx"].tolist())
            return nn.functional.mse_loss(self.lin(batch["x"]), batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def _lightning_fit(root: Path, steps: int, seen: list[int], fail_at: int | None = None,
                   callbacks: list | None = None) -> None:
    import lightning.pytorch as pl

    from petctl.elastic.integrations.lightning import PetctlCallback

    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, default_root_dir=str(root),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, accumulate_grad_batches=2,
                         callbacks=[*(callbacks or []), PetctlCallback()])
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    last = root / "checkpoints" / "last.ckpt"
    trainer.fit(_lightning_module(seen, fail_at), loader, ckpt_path=str(last) if last.is_file() else None)


class _NodeMemory:
    """`FrameworkSnapshots` as local rank 0 of a node under the agent sees it, kept in this process: every
    snapshot the callback takes is serialised as the tier does, and the next fit resumes from the newest."""

    writing = True

    def __init__(self) -> None:
        self.newest: tuple[int, bytes] | None = None
        self.taken: list[int] = []
        self.resumed: int | None = None

    def create(self, options=None) -> _NodeMemory:
        self.resumed = None
        return self

    def take(self, step: int, build, optimizer=None) -> None:
        import io

        buf = io.BytesIO()
        torch.save(build(), buf)
        self.newest = (step, buf.getvalue())
        self.taken.append(step)

    def resume(self, newest_on_disk):
        import io

        if self.newest is None:
            return None
        step, raw = self.newest
        self.resumed = step
        return step, torch.load(io.BytesIO(raw), weights_only=False)

    def close(self) -> None:
        pass


def test_lightning_lost_between_two_micro_batches_resumes_from_the_step_boundary(tmp_path: Path, monkeypatch):
    """The e2e failure (test_framework_data_exactly_once[lightning], round 3): a node SIGKILLed after the
    first micro-batch of step 3; the survivors fail in the second one's backward (DDP's all-reduce). The
    newest in-memory snapshot must be the end of step 2, not the half-accumulated step 3: resumed from
    that, Lightning counts an odd batch of its epoch, steps its optimizer after one micro-batch, and reads
    the stream half a step behind the cursor until its epoch ends (two samples never read, here)."""
    import petctl.elastic.integrations.lightning as lightning

    whole: list[int] = []
    _lightning_fit(tmp_path / "whole", 8, whole)
    memory = _NodeMemory()
    monkeypatch.setattr(lightning, "FrameworkSnapshots", memory)
    first: list[int] = []
    with pytest.raises(RuntimeError, match="a peer is gone"):
        _lightning_fit(tmp_path / "cut", 8, first, fail_at=7)  # steps 0-2, then step 3's first micro-batch
    assert first == whole[:14]
    again: list[int] = []
    _lightning_fit(tmp_path / "cut", 8, again)
    assert memory.resumed == 3
    assert again == whole[12:]  # step 3 again, whole, and on as one run would
    assert memory.taken[:3] == [1, 2, 3]  # one snapshot per completed step, none inside an accumulation


def test_lightning_notice_during_an_accumulation_saves_at_the_step_end(tmp_path: Path, monkeypatch):
    """The save-now flag seen after a step's first micro-batch: every rank saves at that step's end (its
    second micro-batch), never inside the accumulation, and the next round reads on as one run would."""
    import lightning.pytorch as pl

    from petctl.io import controlfiles

    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.setenv(controlfiles.ENV_CONTROL_DIR, str(control))

    class NoticeAt(pl.Callback):
        def __init__(self, calls: int) -> None:
            self.calls, self.seen = calls, 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen += 1
            if self.seen == self.calls:
                controlfiles.write_save_now(control, "n1", deadline=0.0)

    whole: list[int] = []
    _lightning_fit(tmp_path / "whole", 8, whole)
    first: list[int] = []
    _lightning_fit(tmp_path / "cut", 8, first, callbacks=[NoticeAt(7)])  # step 3's first micro-batch
    saved = controlfiles.read_saved(control)
    controlfiles.save_now_path(control).unlink()
    again: list[int] = []
    _lightning_fit(tmp_path / "cut", 8, again)
    assert first + again == whole
    assert saved == {0: 4} and first == whole[:16]


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
