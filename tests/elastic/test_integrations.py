"""The framework callbacks (petctl.elastic.integrations), one process, against the real frameworks.

The protocol half is checked over a control directory as the agent writes it: steps reported, the
save-now flag turned into a save and a stop at that step, the saved marker written after the save, a
checkpoint request turned into a save that trains on. Each framework's callback then runs inside a real
`Trainer.train()` / `Trainer.fit()`: the flag raised at step 3 ends training at step 3 with the
framework's own checkpoint of step 3, and the next run resumes from it at step 4.
The multi-node behaviour (a notice on the local provider, 0 steps redone) is
tests/e2e/test_framework_notice.py.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from petctl.elastic.dist import Comm
from petctl.elastic.integrations.paths import output_dir
from petctl.elastic.integrations.protocol import Action, SaveNowProtocol
from petctl.io import controlfiles
from petctl.io.eventlog import EventLog
from petctl.jobview.failure import WorkerFailure
from tests.support.paths import REPO

pytest.importorskip("transformers")
pytest.importorskip("lightning")

from petctl.elastic.integrations.lightning import devices_per_node, num_nodes  # noqa: E402 (needs lightning)


def events_of(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]


def protocol(control: Path, check_every: int = 1) -> tuple[SaveNowProtocol, io.StringIO]:
    stream = io.StringIO()
    p = SaveNowProtocol(comm=Comm(), check_every=check_every, events=EventLog("elastic", stream=stream))
    return p, stream


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "control"
    directory.mkdir()
    monkeypatch.setenv("PETCTL_CONTROL_DIR", str(directory))
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):  # one process: no torchrun environment
        monkeypatch.delenv(name, raising=False)
    # accelerate sets OMP_NUM_THREADS in os.environ when it is unset: keep that inside this test.
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    return directory


def raise_flag(control: Path) -> None:
    (control / "save_now").write_text(json.dumps({"node_id": "n1", "deadline": 0}))


def test_the_protocol_reports_steps_and_saves_then_stops_at_the_flag(control: Path):
    p, stream = protocol(control)
    p.begin(0)
    assert controlfiles.speaks_protocol(control, 1)  # the agent will flag, not SIGTERM, this worker
    assert p.step_end(1) is Action.NONE
    raise_flag(control)
    assert p.step_end(2) is Action.STOP and p.stopped_at == 2
    p.saved(2, "/ckpt/checkpoint-2")
    assert controlfiles.all_saved(control, 1) and controlfiles.read_saved(control) == {0: 2}
    assert p.step_end(3) is Action.NONE  # sticky: fired once, no more checks
    seen = [(e["event"], e.get("step")) for e in events_of(stream)]
    assert seen == [("checkpoint.resumed", 0), ("train.step", 1), ("train.step", 2), ("save_now.detected", 2),
                    ("checkpoint.saved", 2), ("save_now.saved", 2), ("train.step", 3)]


def test_a_checkpoint_request_saves_once_and_trains_on(control: Path):
    p, stream = protocol(control)
    p.begin(5)
    assert controlfiles.request_checkpoint(control, "rebalance") == 1
    assert p.step_end(6) is Action.SAVE
    p.saved(6, "/ckpt/checkpoint-6")
    assert controlfiles.answered_checkpoint(control, 0) == 1
    assert p.step_end(7) is Action.NONE  # answered: not saved again
    assert not (control / "saved.0").exists()
    saved = [e for e in events_of(stream) if e["event"] == "checkpoint.saved"]
    assert [(e["step"], e["reason"]) for e in saved] == [(6, "requested")]


def test_check_every_0_reports_steps_but_never_speaks_the_protocol(control: Path):
    p, stream = protocol(control, check_every=0)
    p.begin(0)
    raise_flag(control)
    assert p.step_end(1) is Action.NONE
    assert not controlfiles.speaks_protocol(control, 1)  # so the agent SIGTERMs it, as any script
    assert [e["event"] for e in events_of(stream)] == ["checkpoint.resumed", "train.step"]


@pytest.mark.parametrize(("env", "expected"), [
    ({}, (1, 1)),
    ({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1"}, (1, 3)),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, (4, 2)),
    ({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, (1, 1)),  # the world shrank to one node
])
def test_lightning_devices_and_num_nodes_follow_the_world(env: dict, expected: tuple[int, int]):
    assert (devices_per_node(env), num_nodes(environ=env)) == expected


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, {"WORLD_SIZE": "x"},
                                 {"LOCAL_WORLD_SIZE": "0"}])
def test_a_world_that_is_not_whole_nodes_is_one_clear_error(env: dict):
    with pytest.raises(ValueError) as e:
        devices_per_node(env)
        num_nodes(environ=env)
    assert "\n" not in str(e.value)


def test_output_dir_is_the_jobs_shared_directory_and_refuses_s3(tmp_path: Path):
    assert output_dir("out", environ={}) == "out"
    url = (tmp_path / "ckpt").as_uri()
    assert output_dir("out", "hf", environ={"PETCTL_CHECKPOINT_URL": url}) == str(tmp_path / "ckpt" / "hf")
    with pytest.raises(ValueError, match="every node"):
        output_dir("out", environ={"PETCTL_CHECKPOINT_URL": "s3://bucket/jobs/a/checkpoints"})


def test_lightnings_num_nodes_error_comes_with_a_one_line_hint():
    lines = ["Traceback (most recent call last):", "ValueError: You set `devices=1` and `num_nodes=2` in "
             "Lightning, but the product (1 * 2) does not match the world size (1)."]
    failure = WorkerFailure(node="n1", round=3, local_rank=0, code=1, ts=0.0, lines=lines)
    hint = failure.hint()
    assert hint is not None and "num_nodes()" in hint and failure.block()[-1] == hint
    assert failure.to_dict()["hint"] == hint
    assert WorkerFailure(node="n1", round=3, local_rank=0, code=1, ts=0.0, lines=["boom"]).hint() is None


def test_status_prints_a_failure_from_its_json_record_hint_and_all(capsys):
    """`petctl status` renders the record `to_dict` wrote (hint key included) back into the block."""
    from petctl.cli.status import echo_failure

    lines = ["ValueError: ... does not match the world size (1)."]
    failure = WorkerFailure(node="n1", round=3, local_rank=0, code=1, ts=0.0, lines=lines)
    echo_failure(failure.to_dict())
    assert capsys.readouterr().out.splitlines() == failure.block()
    assert WorkerFailure.from_dict(failure.to_dict()) == failure


# --- the callbacks inside the real frameworks (one process, world 1) ---------------------------------
class FlagAt:
    """Raises the agent's save-now flag once `step` steps are done (as a notice would mid-run)."""

    def __init__(self, control: Path, step: int) -> None:
        self.control, self.step = control, step

    def __call__(self, done: int) -> None:
        if done == self.step:
            raise_flag(self.control)


def test_the_trainer_saves_and_stops_at_the_flag_and_resumes_after_it(control: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from petctl.elastic.integrations.transformers import PetctlCallback, last_checkpoint

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.lin(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    data = [{"x": torch.full((4,), float(i)), "labels": torch.ones(1)} for i in range(64)]
    flag = FlagAt(control, 3)

    class Flag(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            flag(state.global_step)

    out = tmp_path / "out"
    assert last_checkpoint(out) is None  # no directory yet: a fresh start, not an error

    def train() -> int:
        args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=2,
                                 use_cpu=True, save_steps=100, report_to=[], disable_tqdm=True,
                                 logging_steps=100)
        callback = PetctlCallback()
        trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[Flag(), callback])
        trainer.train(resume_from_checkpoint=last_checkpoint(out))
        stops.append(callback.stopped)
        return trainer.state.global_step

    stops: list[bool] = []
    assert train() == 3 and stops == [True]  # stopped at the flag's step
    first = _stdout_events(capsys)
    (saved,) = [e for e in first if e["event"] == "checkpoint.saved"]
    assert saved["step"] == 3 and 0 < saved["seconds"] < 60, saved  # timed: a notice's hand-off plans with it
    assert last_checkpoint(out) == str(out / "checkpoint-3")
    assert controlfiles.read_saved(control) == {0: 3}
    for name in os.listdir(control):
        (control / name).unlink()
    assert train() == 6 and stops == [True, False]  # resumed at step 4, ran to the end
    steps = [e["step"] for e in first + _stdout_events(capsys) if e["event"] == "train.step"]
    assert steps == [1, 2, 3, 4, 5, 6]  # no step twice: 0 redone


def test_lightning_saves_and_stops_at_the_flag_and_resumes_after_it(control: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture):
    import lightning.pytorch as pl

    from petctl.elastic.integrations.lightning import PetctlCallback, last_checkpoint

    flag = FlagAt(control, 3)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Flag(pl.Callback):  # listed before PetctlCallback: callbacks run in order (the module's hook after)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            flag(trainer.global_step)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.ones(64, 1))
    root = tmp_path / "root"

    def fit() -> int:
        callback = PetctlCallback()
        trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, default_root_dir=str(root),
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, callbacks=[Flag(), callback])
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        trainer.fit(Module(), loader, ckpt_path=last_checkpoint(root))
        stops.append(callback.stopped)
        return trainer.global_step

    stops: list[bool] = []
    assert last_checkpoint(root) is None
    assert fit() == 3 and stops == [True]
    first = _stdout_events(capsys)
    (saved,) = [e for e in first if e["event"] == "checkpoint.saved"]
    assert saved["step"] == 3 and 0 < saved["seconds"] < 60, saved  # timed: a notice's hand-off plans with it
    assert last_checkpoint(root) == str(root / "checkpoints" / "last.ckpt")
    assert torch.load(last_checkpoint(root), weights_only=False)["global_step"] == 3
    assert controlfiles.read_saved(control) == {0: 3}
    for name in os.listdir(control):
        (control / name).unlink()
    assert fit() == 6 and stops == [True, False]
    steps = [e["step"] for e in first + _stdout_events(capsys) if e["event"] == "train.step"]
    assert steps == [1, 2, 3, 4, 5, 6]


def _stdout_events(capsys: pytest.CaptureFixture) -> list[dict]:
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"')]


def test_the_lightning_callback_is_a_pytorch_lightning_callback_when_the_script_imports_that():
    code = ("import pytorch_lightning as pl\n"
            "from petctl.elastic.integrations.lightning import PetctlCallback\n"
            "assert issubclass(PetctlCallback, pl.Callback), PetctlCallback.__mro__\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
