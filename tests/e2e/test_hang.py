"""Issue 25, defect 4, end to end: a round that hangs with every process alive is restarted like a
failure, and the job fails once --max-restarts is spent, instead of sitting in `running` for good.

The script (no torch: fast) reports 4 steps, writes each to its ledger, then blocks forever with every
process alive: what a rank stuck in a collective looks like from outside. With `--timeout hang=3` and
`--max-restarts 1`, the agent reports `workers.hung` in each round and restarts once; the job then fails
naming the hang. `status -o json` agrees with the ledger: two rounds trained, one failure restart.
Real etcd and agents on the local provider.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import Petctl
from tests.support.matrix import FAST

pytestmark = pytest.mark.slow

STEPS = 4
SCRIPT = f'''
import json, os, sys, time
ledger = os.path.join(os.environ["LEDGER_DIR"], "ledger.jsonl")
for step in range(1, {STEPS} + 1):
    time.sleep(0.05)
    print(json.dumps({{"ts": time.time(), "event": "train.step", "step": step, "rank": 0}}), flush=True)
    with open(ledger, "a") as f:
        f.write(json.dumps({{"round": int(os.environ["PETCTL_ROUND"]), "step": step}}) + "\\n")
time.sleep(1000)  # hung: alive, no progress
'''


@pytest.mark.timeout(180)
def test_a_hung_round_is_restarted_as_a_failure_and_ends_the_job(local: Petctl, tmp_path: Path):
    script, ledger_dir = tmp_path / "hang.py", tmp_path / "ledger"
    script.write_text(SCRIPT)
    ledger_dir.mkdir()
    local.run("run_job", "--name", "hangs", "--min", "1", "--max", "1", "--size", "1", "--max-restarts", "1",
              *FAST, "--timeout", "hang=3", "--env", f"LEDGER_DIR={ledger_dir}", str(script))
    info = local.wait_finished("hangs", timeout=150)
    status = local.status("hangs")
    assert info["state"] == "failed", info
    assert "hang on" in status["reason"] and "max_restarts=1 exhausted" in status["reason"], status["reason"]

    ledger = [json.loads(line) for line in (ledger_dir / "ledger.jsonl").read_text().splitlines()]
    rounds = sorted({e["round"] for e in ledger})
    assert rounds == [1, 2], ledger
    for n in rounds:
        assert [e["step"] for e in ledger if e["round"] == n] == list(range(1, STEPS + 1))
    hung = local.events("hangs", "workers.hung")
    assert sorted(e["round"] for e in hung) == rounds, hung
    accounting = status["accounting"]
    assert (accounting["reforms"], accounting["failure_restarts"]) == (len(rounds) - 1, len(rounds) - 1)
