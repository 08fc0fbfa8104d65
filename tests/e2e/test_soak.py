"""The soak in CI: bench/soak.py with a fixed seed and about 20 overlapping faults against one job on the
local provider (3 nodes, the v3 store), which must end with 0 invariant violations. The full soak (200
faults, any seed, both stores) is bench's; this one is short enough for every run of the suite and has
caught a seeded bug (docs/reliability.md, "Faults together")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.slow

SEED = 98  # its 20 faults draw every one of the 13 local kinds (bench/soakplan.py), 8 of them overlapping
FAULTS = 20


@pytest.mark.timeout(420)
def test_a_short_seeded_soak_ends_with_no_violation(tmp_path: Path):
    # The job's home under pytest's temp root: the session's net kills whatever a timeout leaves running.
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--faults", str(FAULTS), "--seed", str(SEED),
         "--nodes", "3", "--results", str(tmp_path), "--out", "ci", "--max-minutes", "5",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=400)
    report = tmp_path / "ci.json"
    assert report.exists(), f"no report (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    doc = json.loads(report.read_text())
    summary = run.stdout.strip().splitlines()[-1]
    assert doc["violations"] == [], (
        f"{summary}\nfirst violation of each invariant:\n{json.dumps(doc['first_violation'], indent=1)}\n"
        f"node logs: {doc['kept_logs']}")
    assert run.returncode == 0, summary
    injected = [h for h in doc["history"] if h["state"] != "skipped"]
    assert len(injected) >= FAULTS * 3 // 4, f"only {len(injected)} of {FAULTS} faults injected: {summary}"
