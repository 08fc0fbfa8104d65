"""The trace replay's smoke run (issue 28): bench/traces/smoke.json (3 nodes, a notice then a loss without
notice, 40 s of replay) under petctl, through `python bench/run.py`, asserting what happened: both
losses were replayed and replaced, the notice lost no step and the silent loss at most one (in-memory
snapshots), the job trained at world 2 and back at 3, and goodput and cost are figures, not blanks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_trace_smoke_under_petctl(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--scenarios", "smoke",
                          "--systems", "petctl", "--out", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())["results"]["smoke"]["systems"]["petctl"]
    assert "error" not in r, r.get("error")
    o = r["outcome"]
    assert [a["what"] for a in r["actions"]] == ["notice", "kill"]
    assert all(a.get("node") for a in r["actions"])
    assert len(r["launches"]) == 2 and all(x.get("started") for x in r["launches"])
    worlds = [w for _t, _s, w, _node, _round in r["timeline"]]
    assert 3 in worlds and 2 in worlds  # it trained through the losses at world 2
    assert o["steps_lost"] <= 1, o  # the notice: 0; the silent loss: at most the step in flight
    assert 0.0 < o["goodput_measured"] <= 1.0 and o["reforming_s"] > 0
    g = o["goodput_sim"]
    assert g["local-3s"] > g["aws-90s (assumed)"] > g["aws-180s (assumed)"]  # boot time is billed
    cost = r["cost"]["local-3s"]
    assert 0 < cost["spot_usd"] < cost["on_demand_same_hours_usd"]
    assert r["auto_interval"] and r["auto_interval"]["prior"] == "PETCTL_LOSS_RATE"
    assert (out.with_name("r-smoke.png")).stat().st_size > 0
