"""A quick run of the benchmark (1 repetition, smallest sizes, petctl side only) to keep bench/ working.

The benchmark itself is not part of the test suite: this checks that its pipeline (agents against a real
etcd, a silent host loss, a rendezvous of 8 agents, the CLI's cold start) runs and produces the JSON the
README's table is made from, with numbers where numbers belong.
"""

from __future__ import annotations

import json
import numbers
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def test_bench_quick_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--scenarios", "P2,P5,P6",
         "--systems", "petctl", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"P2", "P5", "P6"}
    assert doc["machine"]["cpu_count"] and doc["machine"]["python"]

    p2 = doc["results"]["P2"]["summary"]["petctl"]
    assert _number(p2["seconds"]["median"]), p2
    assert p2["phases_median"], p2
    # Detection, and beside it the TTL-only detection of before issue 16 (bench/scenarios/recovery.py).
    assert _number(p2["detect_s"]["median"]) and _number(p2["all_know_s"]["median"]), p2
    ttl_only = doc["results"]["P2"]["summary"]["petctl-ttl3"]
    assert _number(ttl_only["detect_s"]["median"]), ttl_only
    assert any(r["metric"] == "freeze -> every survivor knows" for r in doc["table"])

    p5 = doc["results"]["P5"]["summary"]["petctl/N=8"]
    assert _number(p5["rdzv_s"]["median"]), p5
    # Every agent enters its first rendezvous after its `agent.started`: the like-for-like figure is
    # never the longer one.
    assert _number(p5["entered_s"]["median"]) and p5["entered_s"]["median"] <= p5["rdzv_s"]["median"], p5
    assert _number(p5["agent_requests_per_node_per_round"]), p5
    # Forming a round of 8 costs each node a handful of requests, not dozens.
    assert 3 <= p5["rdzv_requests_per_node"] <= 30, p5
    # ...and its reads return keys: each node reads at least the round record.
    assert p5["rdzv_keys_per_node"] >= 1, p5
    assert any(r["metric"] == "N=8 keys read/node to form the round (agent count)" for r in doc["table"])
    # P5's nodes start as an instance's install does (no editable finder), and what a ranked node spends
    # starting its worker is counted: the agent's share and the worker's own start-up.
    assert doc["results"]["P5"]["interpreter"].startswith("petctl from the checkout"), doc["results"]["P5"]
    assert 0 < p5["worker_cpu_s"] < 1 and 0 <= p5["agent_cpu_ranked_to_workers_s"] < 1, p5
    # etcd's own count of them, on the v3 API the job uses by default: reads and writes, leases, watches
    served = doc["results"]["P5"]["runs"]["petctl/N=8"][0]["server_requests_per_node"]
    assert served["v3_kv"] > 0 and served["v3_lease"] > 0 and served["v3_watch"] > 0, served

    p6 = doc["results"]["P6"]["commands"]["python -m petctl --help"]
    assert _number(p6["seconds"]["median"]), p6

    assert doc["table"] and all("median" in row for row in doc["table"])
    assert out.with_suffix(".md").exists()
