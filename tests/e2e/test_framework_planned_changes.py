"""Issue 25: with the one-line callback, HF Trainer and Lightning jobs redo no step at a planned scale-up
or scale-in (`petctl scale`), as at a spot notice (tests/e2e/test_framework_notice.py).

Each job runs a framework example as README shows it, with the test's step ledger, on the local
provider. Mid-way between two periodic checkpoints (5-9 steps past one) `petctl scale` changes the size:
up (1 -> 2: the joiner is admitted after every rank saved) or in (2 -> 1: the leaving node saves first).
The script's own ledger has every step exactly once, one round at each world size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import Petctl
from tests.support.frameworks import SAVE_EVERY, STEP_TIME
from tests.support.matrix import FAST, wait_until
from tests.support.paths import WORKLOADS
from tests.support.userledger import UserLedger, end_padding, slow_padding

pytest.importorskip("transformers")
pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

# A scale-up waits for the joiner's agent and its framework imports: room at world 1. A scale-in's leaver
# saves and goes at once: the survivor has 60 or more steps to go alone.
STEPS = {"scale_up": 200, "scale_in": 100}


def mid_period(ledger_dir: Path, world: int) -> int:
    """The step rank 0 completed once it is 5-9 steps past a periodic checkpoint at `world`."""
    def between() -> int | None:
        step = UserLedger.read(ledger_dir).last_step(world=world)
        done = None if step is None else step + 1
        return step if done is not None and done >= SAVE_EVERY and 5 <= done % SAVE_EVERY <= 9 else None
    return wait_until(between, 240, f"a step 5-9 past a periodic checkpoint at world {world}", every=0.05)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", ["hf_train.py", "lightning_train.py"], ids=["transformers", "lightning"])
@pytest.mark.parametrize(("size", "new_size"), [(1, 2), (2, 1)], ids=["scale_up", "scale_in"])
def test_a_planned_scale_change_redoes_no_step_with_the_callback(local: Petctl, tmp_path: Path, script: str,
                                                                 size: int, new_size: int) -> None:
    name = f"{script[:2]}{size}{new_size}"
    steps = STEPS["scale_up" if new_size > size else "scale_in"]
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    local.run("run_job", "--name", name, "--min", "1", "--max", "2", "--size", str(size), *FAST,
              "--env", f"LEDGER_DIR={ledger_dir}", "--wait", "--wait-timeout", "180", str(WORKLOADS / script),
              "--", "--steps", str(steps), "--save-steps", str(SAVE_EVERY), "--step-time", str(STEP_TIME))
    acted_at = mid_period(ledger_dir, size)
    slow_padding(ledger_dir)  # the scale command costs a few steps, not 20 (the next checkpoint)
    local.run("scale", name, "--size", str(new_size))
    wait_until(lambda: UserLedger.read(ledger_dir).last_step(world=new_size) is not None, 240,
               f"a step at world {new_size}")
    end_padding(ledger_dir)  # the change is done, at the padded step: the rest only has to be done
    info = local.wait_finished(name, timeout=360)
    ledger = UserLedger.read(ledger_dir)
    assert info["state"] == "succeeded", (info, ledger.story())
    assert not ledger.missing(steps), f"steps never done: {ledger.missing(steps)[:10]}; {ledger.story()}"
    assert ledger.worlds() == [size, new_size], ledger.story()
    assert not ledger.redone(), f"the scale (at step {acted_at}) lost work: {ledger.describe_redone()}"
