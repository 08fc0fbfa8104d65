"""Issue 25, defects 2 and 6: Lightning's one line (`callbacks=[PetctlCallback()]`) is enough for the
common script shapes, refuses the one that cannot work, and reports each checkpoint once.

Real Lightning, one process (world 1), the agent's save-now flag raised at step 3 as a notice would:
- a script that resumes from its own `ModelCheckpoint(dirpath=...)` (`ckpt_path="last"`, as Lightning's
  docs show) gets the save-now checkpoint there, and the next run redoes no step (the train.step lines
  are the ledger: every step once);
- under petctl, checkpoints inside the worker's working directory (Lightning's default root, per
  instance under petctl) are refused at start in one line naming the fix;
- a periodic `ModelCheckpoint(save_last=True)` save (two files of one step) is one `checkpoint.saved`,
  with the save's time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from petctl.elastic.integrations.lightning import PetctlCallback, last_checkpoint  # noqa: E402


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "control"
    directory.mkdir()
    monkeypatch.setenv("PETCTL_CONTROL_DIR", str(directory))
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "PETCTL_NODE_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    return directory


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FlagAt(pl.Callback):
    """Raises the agent's save-now flag once `step` steps are done (as a notice would mid-run)."""

    def __init__(self, control: Path, step: int) -> None:
        self.control, self.step = control, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            (self.control / "save_now").write_text(json.dumps({"node_id": "n1", "deadline": 0}))


def fit(callbacks: list, root: Path | None, ckpt_path: str | None, max_steps: int = 6) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         **({"default_root_dir": str(root)} if root is not None else {}))
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.ones(64, 1))
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    return trainer


def stdout_events(capsys: pytest.CaptureFixture, name: str) -> list[dict]:
    lines = capsys.readouterr().out.splitlines()
    return [e for e in (json.loads(line) for line in lines if line.startswith('{"')) if e["event"] == name]


@pytest.mark.parametrize("shape", ["newest in dirpath", "ckpt_path=last"])
def test_a_script_resuming_from_its_own_dirpath_redoes_no_step(control: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture, shape: str):
    own = tmp_path / "my-checkpoints"  # the script's ModelCheckpoint dirpath, not <root>/checkpoints

    def run() -> int:
        if shape == "ckpt_path=last":  # Lightning's docs: save_last=True, fit(ckpt_path="last")
            periodic, resume = ModelCheckpoint(dirpath=own, every_n_train_steps=100, save_last=True), "last"
        else:  # the newest checkpoint the script's ModelCheckpoint wrote (failed at main: 3 steps redone)
            periodic, resume = ModelCheckpoint(dirpath=own, every_n_train_steps=5, save_top_k=-1), \
                last_checkpoint(dirpath=own)
        return fit([FlagAt(control, 3), periodic, PetctlCallback()], tmp_path / "root", resume).global_step

    assert run() == 3  # stopped at the flag, saved where the script resumes from
    assert (own / "last.ckpt").is_file()
    for name in os.listdir(control):
        (control / name).unlink()
    assert run() == 6
    steps = [e["step"] for e in stdout_events(capsys, "train.step")]
    assert steps == [1, 2, 3, 4, 5, 6], steps  # every step once: 0 redone


def test_under_petctl_a_per_instance_checkpoint_directory_is_refused_in_one_line(
        control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PETCTL_NODE_ID", "n1")
    with pytest.raises(ValueError, match="own working directory") as e:
        fit([PetctlCallback()], None, None)  # Lightning's default root: the working directory
    assert "\n" not in str(e.value) and "output_dir" in str(e.value)
    assert not (tmp_path / "checkpoints").exists()  # refused before any step or save


def test_a_periodic_save_last_checkpoint_is_reported_once(control: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture):
    periodic = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, save_last=True)
    fit([periodic, PetctlCallback()], tmp_path / "root", None)
    assert {p.name for p in (tmp_path / "ck").iterdir()} >= {"last.ckpt"}  # two files a save
    saved = stdout_events(capsys, "checkpoint.saved")
    assert [e["step"] for e in saved] == [2, 4, 6], saved
    # Each line comes once its files are written, with the save's time (a spot notice's hand-off plans
    # with it).
    assert all(isinstance(e["seconds"], float) and e["seconds"] >= 0 for e in saved), saved
