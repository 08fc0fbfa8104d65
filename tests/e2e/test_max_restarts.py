"""Fault matrix, issue 13 item 5: `--max-restarts` exhausted. The job ends `failed`, and `petctl status`
says why in the failing worker's own words (its last error lines), not just "max_restarts=2 exhausted".

A bug in the user's script (rank 0 raises at step 7) fails every round the same way. Checkpoints every
5 steps: the first round runs steps 0..6 and saves step 4; the one restart allowed resumes from step 4
and runs 5 and 6 again, and its failure ends the job. In-memory snapshots are off (PETCTL_SNAPSHOTS=0):
with them the restart would resume at step 7 and fail before any step (tests/e2e/test_node_loss.py
covers them). Real etcd, agents and gloo workers on the local provider.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import Petctl
from tests.support.ledger import Ledger, manifests
from tests.support.matrix import run_ledger_job

pytestmark = pytest.mark.slow

STEPS, FAIL_AT, EVERY, MAX_RESTARTS = 40, 7, 5, 1
ERROR = f"RuntimeError: injected failure at step {FAIL_AT} (FAIL_AT)"


@pytest.mark.timeout(180)
def test_exhausted_restarts_fail_the_job_and_status_shows_the_workers_error(local: Petctl, tmp_path: Path):
    ledger_dir = tmp_path / "ledger"
    run_ledger_job(local, ledger_dir, "crashy", "--min", "1", "--max", "2", "--size", "2", "--max-restarts",
                   str(MAX_RESTARTS), STEPS=STEPS, FAIL_AT=FAIL_AT, CKPT_EVERY=EVERY, STEP_TIME=0.02,
                   PETCTL_SNAPSHOTS=0)
    info = local.wait_finished("crashy", timeout=150)
    assert info["state"] == "failed", info
    status = local.status("crashy")
    assert status["state"] == "failed" and f"max_restarts={MAX_RESTARTS} exhausted" in status["reason"]

    # The ledger: 1 + max_restarts rounds trained, each on both nodes with the same two ranks, each
    # stopping at the failing step; the first ran from 0, every restart from the checkpoint of step 4.
    ledger = Ledger.read(ledger_dir)
    runs = ledger.training_rounds()
    assert len(runs) == 1 + MAX_RESTARTS, [r.round for r in runs]
    for run in runs:
        assert sorted(run.ranks.values()) == [0, 1] and run.worlds == {2}, run
        assert {tuple(s) for s in run.steps.values()} == (
            {tuple(range(FAIL_AT))} if run is runs[0] else {tuple(range(EVERY, FAIL_AT))}), run.steps
    assert [r.loaded for r in runs] == [{None}] + [{EVERY - 1}] * MAX_RESTARTS
    ledger.assert_exact(STEPS)  # every step's weights are the replay's: each resume loaded step 4 exactly
    assert ledger.redone() == [FAIL_AT - EVERY] * MAX_RESTARTS
    assert manifests(local.job_dir("crashy") / "checkpoints") == [EVERY - 1]
    assert not (ledger_dir / "final.json").exists()

    # Every failure of rank 0's worker carried its last error lines in `workers.failed`.
    rank0 = {r.round: next(n for n, k in r.ranks.items() if k == 0) for r in runs}
    failed = {(e["round"], e["node"]): e for e in local.events("crashy", "workers.failed")}
    for round_no, node in rank0.items():
        lines = failed[(round_no, node)]["last_error"]
        assert lines[-1].endswith(ERROR) and len(lines) <= 20, lines  # torch prefixes "[rank0]: "
        assert any(line.endswith("Traceback (most recent call last):") for line in lines)

    # `petctl status -o json`: the failure of the last round, rank 0's: the cause. Its peer fails after it
    # (gloo: "Connection closed by peer"), if at all before the job ends; that one is only counted.
    last_round, cause = max(rank0.items())
    error = status["last_error"]
    assert (error["node"], error["round"], error["local_rank"], error["code"]) == (cause, last_round, 0, 1)
    assert error["lines"][-1].endswith(ERROR) and error["others"] in (0, 1)

    # The table: one indented block under the heading, at most 20 lines, ending with the error.
    text = local.run("status", "crashy").stdout.splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("last worker error"))
    assert text[start].startswith(f"last worker error (node {cause}, round {last_round}, local rank 0, "
                                  "exit code 1")
    block = [line for line in text[start + 1:start + 22] if line.startswith("    ")]
    assert 2 <= len(block) <= 20 and block[-1].endswith(ERROR), json.dumps(text, indent=1)
    assert block[-1].startswith("    ") and any(line.endswith("Traceback (most recent call last):")
                                                for line in block)
    assert len(local.processes()) == 1  # etcd only
