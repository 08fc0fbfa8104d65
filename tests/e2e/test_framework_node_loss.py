"""Issue 25: with the one-line callback, a node lost without warning costs HF Trainer and Lightning users
at most one step, as it costs `Checkpointer` users (tests/e2e/test_node_loss.py).

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
from pathlib import Path

import pytest

from tests.support.cli import Petctl
from tests.support.paths import WORKLOADS
from tests.support.snapshotloss import (
    Drill,
    finish,
    run_and_kill_one,
    snapshot_root,  # noqa: F401 - a fixture
)

pytest.importorskip("transformers")
pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

# The kill comes 3-24 steps past step 20 (by step 45 or so), at least 40 steps before the end; the
# survivors' steps after their first go unpadded (tests/support/snapshotloss.py: finish).
STEPS = 100
SAVE_EVERY = 20
STEP_TIME = 0.05


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "script"), [("hfkill", "hf_train.py"), ("plkill", "lightning_train.py")],
                         ids=["transformers", "lightning"])
def test_a_node_killed_at_a_random_step_costs_a_framework_job_at_most_one_step(
        local: Petctl, tmp_path: Path, snapshot_root: Path, name: str, script: str) -> None:  # noqa: F811
    seed = int(os.environ.get("PETCTL_TEST_SEED") or random.randrange(1 << 30))
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    # Past the first periodic checkpoint (step 20): memory must beat a file that exists, not an empty disk.
    drill = Drill(name, WORKLOADS / script, ("--steps", str(STEPS), "--save-steps", str(SAVE_EVERY)), STEPS,
                  STEP_TIME, offsets=(3, 25), margin=40, after_step=SAVE_EVERY, launch_timeout=180,
                  finish_timeout=360)
    kill = run_and_kill_one(local, drill, ledger_dir, snapshot_root, seed)
    info, ledger, story = finish(local, drill, tmp_path, ledger_dir, kill)
    assert info["state"] == "succeeded", (info, story)
    missing = ledger.missing(STEPS)
    if missing and kill.victim_rank == 0:
        # The ledger is rank 0's. Killed after its step's all-reduce and before its ledger line, rank 0
        # takes that one line with it while the survivors finish the step and snapshot it: the step is
        # kept, only unrecorded. Tolerated only as exactly that: one step, resumed right after it.
        resumed = [e["start"] for e in ledger.of("resumed") if e["ts"] > kill.at]
        assert len(missing) == 1 and resumed and resumed[0] == missing[0] + 1, (missing, resumed, story)
        missing = []
    assert not missing, f"steps never done: {missing[:10]}; {story}"
    redone = ledger.redone()
    assert len(redone) <= 1, f"{kill.why}: the loss cost more than one step: {ledger.describe_redone()}"
    loads = [e for e in local.events(name, "checkpoint.loaded") if e["ts"] > kill.at]
    back = [e for e in ledger.of("step") if e["ts"] > kill.at]
    print(json.dumps({"why": kill.why, "loaded": [(e.get("source"), e.get("step")) for e in loads],
                      "redone": sorted(redone), "rounds": ledger.story(),
                      "back_after_s": round(back[0]["ts"] - kill.at, 2) if back else None}))
    assert loads and {e.get("source") for e in loads} == {"snapshot"}, (loads, story)
    assert not local.events(name, "snapshot.disabled"), story
