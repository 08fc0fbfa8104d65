"""Issue 45: with the one-line callback, a Hugging Face Trainer job and a Lightning job read every sample of
every epoch exactly once while the world changes size, and a kill re-reads only the redone steps' samples.

Each job runs a script as the framework's docs show it (tests/workloads/hf_data.py: `get_last_checkpoint`
before the Trainer is built; lightning_data.py: `fit(ckpt_path="last")`), `callbacks=[PetctlCallback()]`,
gradient accumulation of 2, a dataset of 41 samples (an epoch every 3-10 steps), and a sample ledger: rank
0 records the dataset indices every rank read at each optimizer step. On the local provider (min 1, max 3):
world 2, a scale-up to 3, a spot notice on rank 2's node (its replacement takes its place: world 3), a
scale-down to 2, and a SIGKILL of rank 1's node (world 1; its replacement is scaled away before it can
join), each in the middle of an epoch, and the job runs on to its last step.

The ledger's kept steps, put in global order, must hold each epoch's 41 indices exactly once. The planned
changes (scale-up, notice, scale-down) redo nothing; the kill redoes at most one step (the in-memory
snapshot, found through the framework's own resume), and the redone records must be exactly the samples
the next round read again at the same positions: nothing else is read twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import Petctl
from tests.support.dataledger import DataLedger, epoch_problems, positions
from tests.support.matrix import FAST, wait_until
from tests.support.paths import WORKLOADS
from tests.support.snapshotloss import snapshot_root  # noqa: F401 - a fixture
from tests.support.userledger import end_padding, slow_padding
from tests.workloads.data_ledger import SIZE

pytest.importorskip("transformers")
pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

# Padded steps while the world changes (0.1 s, then 0.5 s from the scale-up on: a joiner imports torch for
# 10 s or more while the others train on), then unpadded at world 1: the tiny model's steps take ms.
STEPS = 800
STEP_TIME = 0.1


def steps_at(ledger_dir: Path, world: int, after_round: int = -1) -> int:
    """Steps rank 0 recorded at `world` in rounds after `after_round`."""
    steps = DataLedger.read(ledger_dir).of("step")
    return sum(1 for e in steps if e["world"] == world and e["round"] > after_round)


def last_round(ledger_dir: Path) -> int:
    return max(e["round"] for e in DataLedger.read(ledger_dir).of("step"))


def node_of(cli: Petctl, job: str, rank: int) -> str:
    (node,) = [n for n, r in cli.status(job)["ranks"].items() if r == rank]
    return node


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("job", "script"), [("hfdata", "hf_data.py"), ("pldata", "lightning_data.py")],
                         ids=["transformers", "lightning"])
def test_every_sample_once_per_epoch_across_world_changes(local: Petctl, tmp_path: Path,
                                                         snapshot_root: Path, job: str,  # noqa: F811
                                                         script: str) -> None:
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    local.env["PETCTL_SNAPSHOT_ROOT"] = str(snapshot_root)
    local.run("run_job", "--name", job, "--min", "1", "--max", "3", "--size", "2", "--replace-delay", "1",
              *FAST, "--env", f"LEDGER_DIR={ledger_dir}", "--wait", "--wait-timeout", "120",
              str(WORKLOADS / script), "--", "--steps", str(STEPS), "--save-steps", "10",
              "--step-time", str(STEP_TIME))
    wait_until(lambda: steps_at(ledger_dir, 2) >= 3, 120, "3 steps at world 2", every=0.05)
    slow_padding(ledger_dir)  # a joiner imports for 10 s or more: tens of steps, not hundreds
    local.run("scale", job, "--size", "3")
    wait_until(lambda: steps_at(ledger_dir, 3) >= 3, 120, "3 steps at world 3", every=0.05)
    # AWS's two minutes: the noticed node trains on until its replacement is ready, then hands off to it.
    noticed_round = last_round(ledger_dir)
    local.run("chaos", job, "--node", node_of(local, job, 2), "--notice", "--grace", "120")
    wait_until(lambda: steps_at(ledger_dir, 3, after_round=noticed_round) >= 3, 150,
               "3 steps at world 3 after the hand-off", every=0.05)
    handed_round = last_round(ledger_dir)
    local.run("scale", job, "--size", "2")
    wait_until(lambda: steps_at(ledger_dir, 2, after_round=handed_round) >= 3, 120,
               "3 steps at world 2 after the scale-down", every=0.05)
    killed_round = last_round(ledger_dir)
    local.run("chaos", job, "--node", node_of(local, job, 1), "--kill")
    # The group launches a replacement (booting 1 s, then importing for 10 s or more); a desired size of
    # 1 ends it before it can join, so the job finishes at world 1.
    local.run("scale", job, "--size", "1")
    wait_until(lambda: steps_at(ledger_dir, 1) >= 1, 120, "a step at world 1", every=0.05)
    end_padding(ledger_dir)
    info = local.wait_finished(job, timeout=120)
    ledger = DataLedger.read(ledger_dir)
    story = ledger.story()
    assert info["state"] == "succeeded", (info, story)
    assert ledger.of("done"), story
    worlds = [w for i, w in enumerate(e["world"] for e in ledger.of("step"))
              if i == 0 or w != ledger.of("step")[i - 1]["world"]]
    assert worlds == [2, 3, 2, 1], story
    assert len({e["round"] for e in ledger.of("step") if e["world"] == 3}) >= 2, story  # the hand-off's

    # Every epoch's samples exactly once, across four worlds and many epoch boundaries.
    stream = ledger.stream()
    assert len(stream) > 3 * SIZE, (len(stream), story)
    assert not epoch_problems(stream, SIZE), (epoch_problems(stream, SIZE), story)

    # The planned changes redo nothing; the kill at most one step, and re-reads exactly its samples.
    kept, redone = ledger.split()
    assert {e["round"] for e in redone} <= {killed_round}, (redone, story)
    assert len(redone) <= 1, (redone, story)
    for e in redone:
        start = sum(len(positions(kept[s])) for s in range(e["step"]))
        again = stream[start:start + len(positions(e))]
        assert sorted(again) == sorted(positions(e)), (e, again, story)
    # The world changed mid-epoch (where a per-rank cut repeats or skips samples): steps read multiples of
    # 4 samples and an epoch is 41, so a resume lands on an epoch's start 1 time in 41.
    resumed = [(e["step"], e["offset"]) for e in local.events(job, "data.resumed") if e["step"] > 0]
    assert len(resumed) == 4 and any(offset for _, offset in resumed), (resumed, story)
    print(json.dumps({"rounds": story, "samples": len(stream), "redone": [e["step"] for e in redone],
                      "resumed": resumed, "loaded": [(e.get("source"), e.get("step"))
                                                     for e in local.events(job, "checkpoint.loaded")]}))
