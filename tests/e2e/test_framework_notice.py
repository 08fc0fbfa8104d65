"""Issue 15: Hugging Face Trainer and Lightning jobs lose no step at a spot notice, and their status is true.

Each job runs a framework example as README shows it (examples/hf_trainer.py, examples/lightning_ddp.py:
a tiny model from a config, the framework's own periodic checkpoints every 20 steps, resumed from the
newest one, `callbacks=[PetctlCallback()]`), with a step ledger added (tests/workloads/), on the local
provider: 2 nodes of max 2, real etcd,
agents and gloo workers. Mid-way between two periodic checkpoints rank 1's node gets a spot notice; the
replacement is held back, so the survivor finishes alone at world 1.

With the callback every rank saves the step the notice arrived at and the survivor resumes at the next
one: the script's own ledger (rank 0's completed steps) has every step once, and `petctl status -o json`
shows the final step and 0 steps lost. The same script without the callback (`--no-petctl`) gets SIGTERM
at the notice and resumes from its last periodic checkpoint: steps redone, and a status that cannot know
the steps says so (`steps_reported` false) instead of claiming none were lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import Petctl
from tests.support.frameworks import SAVE_EVERY, STEP_TIME
from tests.support.matrix import FAST, wait_until
from tests.support.paths import WORKLOADS
from tests.support.userledger import UserLedger, end_padding, slow_padding

pytest.importorskip("transformers")  # the `test` extra installs both frameworks (constraints.txt pins them)
pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

STEPS = 100  # the notice comes 25-29 steps in (5-9 past the first checkpoint): 70 or so to go alone


def run_framework_job(cli: Petctl, name: str, script: str, ledger_dir: Path, *script_args: str) -> None:
    ledger_dir.mkdir(parents=True, exist_ok=True)
    cli.run("run_job", "--name", name, "--min", "1", "--max", "2", "--size", "2", "--replace-delay", "600",
            *FAST, "--env", f"LEDGER_DIR={ledger_dir}", "--wait", "--wait-timeout", "120",
            str(WORKLOADS / script), "--", "--steps", str(STEPS), "--save-steps", str(SAVE_EVERY),
            "--step-time", str(STEP_TIME), *script_args)


def notice_mid_period(cli: Petctl, name: str, ledger_dir: Path) -> int:
    """Once rank 0 is 5-9 steps past a periodic checkpoint (the 2nd or later), give rank 1's node a spot
    notice; returns the step rank 0 had completed then."""
    def between() -> int | None:
        step = UserLedger.read(ledger_dir).last_step(world=2)
        done = None if step is None else step + 1  # completed steps: checkpoint-<done> would hold them
        return step if done is not None and done >= SAVE_EVERY and 5 <= done % SAVE_EVERY <= 9 else None
    acted_at = wait_until(between, 180, "a step 5-9 past a periodic checkpoint at world 2", every=0.05)
    slow_padding(ledger_dir)  # the two CLI calls below cost a few steps, not 20 (the next checkpoint)
    (leaver,) = [node for node, rank in cli.status(name)["ranks"].items() if rank == 1]
    cli.run("chaos", name, "--node", leaver, "--notice", "--grace", "30")
    return acted_at


def finish(cli: Petctl, name: str, ledger_dir: Path) -> tuple[UserLedger, dict, dict]:
    """The job's ledger, its status while training at world 1, and its final status, once it succeeded."""
    wait_until(lambda: UserLedger.read(ledger_dir).last_step(world=1) is not None, 180, "a step at world 1")
    running = cli.status(name)
    end_padding(ledger_dir)  # what the step's time mattered for is seen: the rest only has to be done
    info = cli.wait_finished(name, timeout=300)
    ledger = UserLedger.read(ledger_dir)
    assert info["state"] == "succeeded", (info, ledger.story())
    assert not ledger.missing(STEPS), f"steps never done: {ledger.missing(STEPS)[:10]}; {ledger.story()}"
    assert ledger.worlds() == [2, 1], ledger.story()
    assert len(ledger.of("done")) == 1, ledger.story()
    return ledger, running, cli.status(name)


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("name", "script"), [("hf", "hf_train.py"), ("pl", "lightning_train.py")],
                         ids=["transformers", "lightning"])
def test_a_notice_loses_no_step_with_the_callback(local: Petctl, tmp_path: Path, name: str, script: str):
    ledger_dir = tmp_path / "ledger"
    run_framework_job(local, name, script, ledger_dir)
    acted_at = notice_mid_period(local, name, ledger_dir)
    ledger, running, final = finish(local, name, ledger_dir)
    assert not ledger.redone(), f"the notice (at step {acted_at}) lost work: {ledger.describe_redone()}"
    # While it trains at world 1 the survivor's node shows its step (completed steps: the ledger's + 1).
    (node,) = [n for n in running["nodes"].values() if n.get("world_size") == 1]
    assert node["step"] is not None and acted_at < node["step"] <= STEPS, running["nodes"]
    accounting = final["accounting"]
    assert accounting["steps_reported"] is True, accounting
    assert (accounting["steps_kept"], accounting["steps_lost"]) == (STEPS, 0), accounting


@pytest.mark.timeout(420)
def test_without_the_callback_the_same_script_redoes_steps_and_status_says_so(local: Petctl, tmp_path: Path):
    ledger_dir = tmp_path / "ledger"
    run_framework_job(local, "plainhf", "hf_train.py", ledger_dir, "--no-petctl")
    acted_at = notice_mid_period(local, "plainhf", ledger_dir)
    ledger, running, final = finish(local, "plainhf", ledger_dir)
    redone = ledger.redone()
    # SIGTERM soon after step acted_at (5-9 past a checkpoint); the next round resumes from that checkpoint.
    assert redone, f"notice at step {acted_at}, yet no step redone: {ledger.story()}"
    assert all(n.get("step") is None for n in running["nodes"].values()), running["nodes"]
    accounting = final["accounting"]
    assert accounting["steps_reported"] is False, accounting  # never "0 steps lost" for unknown steps
