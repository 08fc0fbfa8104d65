"""Issue 25: with the one-line callback, a node lost without warning costs HF Trainer and Lightning users
at most one step, as it costs `Checkpointer` users (tests/test_snapshot_loss.py).

Each job runs a framework example as README shows it (examples/hf_trainer.py, examples/lightning_ddp.py:
the framework's own checkpoints every 20 steps on the job's shared directory, resumed with
`last_checkpoint`, `callbacks=[PetctlCallback()]`), with the test's step ledger (tests/workloads/), on
3 nodes of the local provider (min 2, no replacement). Past the first periodic checkpoint, a random
rank's node is SIGKILLed with its agent at a random step: nobody saves first. The survivors re-form
and resume from the framework checkpoint their nodes kept in memory (`checkpoint.loaded` with
`source=snapshot`), not from the periodic one up to 19 steps older: the script's own ledger has every
step, at most one of them twice. The seed is in every assertion message (PETCTL_TEST_SEED repeats a run).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from tests.support.cli import Petctl
from tests.support.matrix import FAST, wait_until
from tests.support.snapshotloss import snapshot_root  # noqa: F401 - a fixture
from tests.support.userledger import UserLedger

pytest.importorskip("transformers")
pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

WORKLOADS = Path(__file__).resolve().parent / "workloads"
STEPS = 160
SAVE_EVERY = 20
STEP_TIME = 0.05


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "script"), [("hfkill", "hf_train.py"), ("plkill", "lightning_train.py")],
                         ids=["transformers", "lightning"])
def test_a_node_killed_at_a_random_step_costs_a_framework_job_at_most_one_step(
        local: Petctl, tmp_path: Path, snapshot_root: Path, name: str, script: str) -> None:  # noqa: F811
    seed = int(os.environ.get("PETCTL_TEST_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    offset, victim_rank = rng.randrange(3, 25), rng.randrange(3)
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    local.env["PETCTL_SNAPSHOT_ROOT"] = str(snapshot_root)
    local.run("run_job", "--name", name, *FAST, "--min", "2", "--max", "3", "--size", "3",
              "--replace-delay", "600", "--env", f"LEDGER_DIR={ledger_dir}", "--wait",
              "--wait-timeout", "180", str(WORKLOADS / script), "--", "--steps", str(STEPS),
              "--save-steps", str(SAVE_EVERY), "--step-time", str(STEP_TIME))
    # Past the first periodic checkpoint (step 20): memory must beat a file that exists, not an empty disk.
    wait_until(lambda: (UserLedger.read(ledger_dir).last_step(world=3) or -1) >= SAVE_EVERY, 240,
               "step 20 at world 3", every=0.05)
    kill_at = UserLedger.read(ledger_dir).last_step(world=3) + offset
    why = f"seed {seed}: SIGKILL of rank {victim_rank}'s node at step {kill_at}"
    assert kill_at < STEPS - 40, f"{why}: the job got too far before the kill"
    wait_until(lambda: (UserLedger.read(ledger_dir).last_step(world=3) or -1) >= kill_at, 180,
               f"step {kill_at} at world 3 ({why})", every=0.02)
    time.sleep(rng.uniform(0, STEP_TIME))
    (victim,) = [node for node, rank in local.status(name)["ranks"].items() if rank == victim_rank]
    t_kill = time.time()
    local.run("chaos", name, "--node", victim, "--kill")

    info = local.wait_finished(name, timeout=360)
    ledger = UserLedger.read(ledger_dir)
    story = f"{why}; {ledger.story()}"
    assert info["state"] == "succeeded", (info, story)
    missing = ledger.missing(STEPS)
    if missing and victim_rank == 0:
        # The ledger is rank 0's. Killed after its step's all-reduce and before its ledger line, rank 0
        # takes that one line with it while the survivors finish the step and snapshot it: the step is
        # kept, only unrecorded. Tolerated only as exactly that: one step, resumed right after it.
        resumed = [e["start"] for e in ledger.of("resumed") if e["ts"] > t_kill]
        assert len(missing) == 1 and resumed and resumed[0] == missing[0] + 1, (missing, resumed, story)
        missing = []
    assert not missing, f"steps never done: {missing[:10]}; {story}"
    redone = ledger.redone()
    assert len(redone) <= 1, f"{why}: the loss cost more than one step: {ledger.describe_redone()}"
    loads = [e for e in local.events(name, "checkpoint.loaded") if e["ts"] > t_kill]
    back = [e for e in ledger.of("step") if e["ts"] > t_kill]
    print(json.dumps({"why": why, "loaded": [(e.get("source"), e.get("step")) for e in loads],
                      "redone": sorted(redone), "rounds": ledger.story(),
                      "back_after_s": round(back[0]["ts"] - t_kill, 2) if back else None}))
    assert loads and {e.get("source") for e in loads} == {"snapshot"}, (loads, story)
    assert not local.events(name, "snapshot.disabled"), story
