"""The framework callbacks' in-memory snapshot tier, one process, against the real frameworks.

A run is cut short by an exception at step 5 (a worker gone without saving), with the framework's own
periodic checkpoints at steps 2 and 4 on disk and the agent's snapshot directory set as the agent sets it.
The next round (a new `Trainer`, PETCTL_ROUND + 1) resumes from node memory at step 5, not from disk at
step 4: no step is reported twice, and the final weights equal an uninterrupted run's. A snapshot of an
older round than the disk's newest checkpoint is passed over. The multi-node drill (a node SIGKILLed) is
tests/e2e/test_framework_node_loss.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("lightning")

STEPS = 8
CRASH_AT = 5


class Crash(Exception):
    pass


@pytest.fixture
def agent_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The variables the agent gives a worker, for one process; returns the snapshot directory."""
    snap = tmp_path / "snap"
    snap.mkdir(mode=0o700)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "PETCTL_SNAPSHOTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PETCTL_SNAPSHOT_DIR", str(snap))
    monkeypatch.setenv("PETCTL_JOB", "memjob")
    monkeypatch.setenv("PETCTL_ROUND", "1")
    monkeypatch.setenv("PETCTL_CONTROL_DIR", str(tmp_path / "control"))
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    return snap


def _steps(capsys: pytest.CaptureFixture) -> tuple[list[int], list[dict]]:
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"')]
    return [e["step"] for e in events if e["event"] == "train.step"], events


def _hf_run(out: Path, crash: bool, docs_way: bool = False) -> torch.Tensor:
    """docs_way: resume as Hugging Face's docs show, `get_last_checkpoint(output_dir)` found before the
    Trainer is built (not petctl's `last_checkpoint` after)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from petctl.elastic.integrations.transformers import PetctlCallback, last_checkpoint

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.lin(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    class Die(TrainerCallback):  # after PetctlCallback: the step's snapshot is taken, then the worker dies
        def on_step_end(self, args, state, control, **kwargs):
            if crash and state.global_step == CRASH_AT:
                raise Crash

    data = [{"x": torch.full((4,), float(i % 7)), "labels": torch.ones(1)} for i in range(64)]
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2,
                             use_cpu=True, save_steps=2, report_to=[], disable_tqdm=True, logging_steps=100,
                             learning_rate=0.05)
    model = Tiny()
    found = get_last_checkpoint(str(out)) if docs_way and out.is_dir() else None
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[PetctlCallback(), Die()])
    trainer.train(resume_from_checkpoint=found if docs_way else last_checkpoint(out))
    return model.lin.weight.detach().clone()


@pytest.mark.parametrize("docs_way", [False, True], ids=["last_checkpoint", "get_last_checkpoint_first"])
def test_the_trainer_resumes_from_node_memory_not_from_the_older_disk_checkpoint(
        agent_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        docs_way: bool):
    expected = _hf_run(tmp_path / "plain", crash=False)  # uninterrupted (it keeps snapshots too)
    capsys.readouterr()
    out = tmp_path / "out"
    monkeypatch.setenv("PETCTL_JOB", f"memjob-hf-{docs_way}")
    with pytest.raises(Crash):
        _hf_run(out, crash=True)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    monkeypatch.setenv("PETCTL_ROUND", "2")
    weights = _hf_run(out, crash=False, docs_way=docs_way)  # the script asks for checkpoint-4
    steps, events = _steps(capsys)
    assert steps == list(range(1, STEPS + 1)), steps  # step 5 once: resumed after it, from memory
    loaded = [e for e in events if e["event"] == "checkpoint.loaded"]
    assert [(e["source"], e["step"]) for e in loaded] == [("snapshot", CRASH_AT)], loaded
    resumed = [e for e in events if e["event"] == "checkpoint.resumed"]
    assert [(e["source"], e["step"]) for e in resumed][-1] == ("snapshot", CRASH_AT), resumed
    assert torch.allclose(weights, expected, atol=1e-6), (weights, expected)
    assert (agent_env / "framework.snap").is_file()


def _pl_run(root: Path, crash: bool, periodic: bool, seen: dict[str, torch.Tensor]) -> None:
    """Fit; `seen` gets the weights when training started and (crash) at the crash."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from petctl.elastic.integrations.lightning import PetctlCallback, last_checkpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    class Die(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["start"] = pl_module.lin.weight.detach().clone()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if crash and trainer.global_step == CRASH_AT:
                seen["crash"] = pl_module.lin.weight.detach().clone()
                raise Crash

    saves = [ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)] if periodic else []
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, default_root_dir=str(root),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=periodic, callbacks=[*saves, PetctlCallback(), Die()])
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.ones(64, 1))
    module = Module()
    ckpt = last_checkpoint(dirpath=root) if periodic else None
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt)


@pytest.mark.parametrize("periodic", [True, False], ids=["ckpt-on-disk", "no-ckpt-on-disk"])
def test_lightning_resumes_from_node_memory_with_or_without_a_checkpoint_on_disk(
        agent_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        periodic: bool):
    root = tmp_path / "root"
    crashed: dict[str, torch.Tensor] = {}
    with pytest.raises(Crash):
        _pl_run(root, crash=True, periodic=periodic, seen=crashed)
    monkeypatch.setenv("PETCTL_ROUND", "2")
    resumed: dict[str, torch.Tensor] = {}
    _pl_run(root, crash=False, periodic=periodic, seen=resumed)
    steps, events = _steps(capsys)
    assert steps == list(range(1, STEPS + 1)), steps
    loaded = [e for e in events if e["event"] == "checkpoint.loaded"]
    assert [(e["source"], e["step"]) for e in loaded] == [("snapshot", CRASH_AT)], loaded
    resumed_at = [e for e in events if e["event"] == "checkpoint.resumed"]
    assert [(e["source"], e["step"]) for e in resumed_at][-1] == ("snapshot", CRASH_AT), resumed_at
    assert not [e for e in events if e["event"] == "checkpoint.saved" and e.get("step") == CRASH_AT - 1
                and e.get("reason") == "periodic" and not periodic]  # a snapshot's dump is no save
    # Lightning restarts a partly trained epoch's data on any resume (docs/elastic.md), so the run's end
    # differs from an uninterrupted one's; the state it resumed with is exactly the crashed step's.
    assert torch.equal(resumed["start"], crashed["crash"]), (resumed, crashed)


def test_a_disk_checkpoint_newer_than_memory_wins(agent_env: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture):
    from petctl.elastic.integrations.transformers import memory_checkpoint

    out = tmp_path / "out"
    monkeypatch.setenv("PETCTL_JOB", "memjob-old")
    with pytest.raises(Crash):
        _hf_run(out, crash=True)  # memory: step 5; disk: 2 and 4
    (out / "checkpoint-4").rename(out / "checkpoint-6")  # as if a later round saved step 6
    monkeypatch.setenv("PETCTL_ROUND", "2")
    from petctl.elastic.integrations.memory import FrameworkSnapshots

    memory = FrameworkSnapshots.create()
    assert memory.resume(lambda: 6) is None and memory_checkpoint() is None
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"')]
    assert [e["event"] for e in events if e["event"].startswith("snapshot.")][-1] == "snapshot.passed_over"


def test_a_framework_run_names_the_tier_it_resumed_from() -> None:
    """`checkpoint.resumed` said "framework" for a step the in-memory tier had handed the framework, so
    the durable interval (every="auto") missed a silent loss and `petctl events` the tier."""
    from petctl.elastic.integrations.protocol import resumed_source

    assert resumed_source(5, 5) == "snapshot"
    assert resumed_source(6, 5) == "framework"  # the disk was newer than memory
    assert resumed_source(4, None) == "framework"
    assert resumed_source(0, None) == "none" and resumed_source(0, 0) == "none"
