"""The trace replay's smoke run (issue 28): bench/traces/smoke.json (3 nodes, a notice then a loss without
notice, 40 s of replay) under petctl, through `python bench/run.py`, asserting what happened: both
losses were replayed and replaced, the notice lost no step and the silent loss at most one (in-memory
snapshots), the job trained at world 2 and back at 3, both goodput figures and the cost are figures, not
blanks, and the replay kept to its schedule (issue 43)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_trace_smoke_under_petctl(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--scenarios", "smoke",
                          "--systems", "petctl", "--boot", "30", "--out", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["dirty"] is not None and "load_avg_end" in doc["machine"]
    res = doc["results"]["smoke"]
    assert res["boot_s"] == 30.0 and res["boot_replayed_s"] == 3.0
    r = res["systems"]["petctl"]["runs"][0]
    assert "error" not in r, r.get("error")
    assert r["valid"], r["late"]
    o = r["outcome"]
    assert [a["what"] for a in r["actions"]] == ["notice", "kill"]
    assert all(a.get("node") for a in r["actions"])
    # the notice's replacement at the notice, the loss's at the loss; each booted 3 replayed s later
    assert len(r["launches"]) == 2 and all(x.get("started") for x in r["launches"])
    assert all(abs(x["started"] - x["launched"] - 3.0) < 0.5 for x in r["launches"])
    worlds = [w for _t, _s, w, _node, _round in r["timeline"]]
    assert 3 in worlds and 2 in worlds  # the silent loss: world 2 until its replacement booted
    assert o["steps_lost"] <= 1, o  # the notice: 0; the silent loss: at most the step in flight
    assert 0.0 < o["goodput_measured"] <= o["goodput_scaled"] <= 1.0 and o["reforms"] >= 1
    assert o["billed_node_s"] > 0
    cost = r["cost"]
    assert 0 < cost["spot_usd"] < cost["on_demand_same_hours_usd"]
    assert r["auto_interval"] and r["auto_interval"]["prior"] == "PETCTL_LOSS_RATE"
    assert (out.with_name("r-smoke.png")).stat().st_size > 0
