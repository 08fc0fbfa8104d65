"""The fleet bench (bench/fleet.py, P9) on a small fleet, both backends: it runs, and its figures say
what each backend's liveness costs (a v3 keep-alive is no raft proposal; a v2 refresh is one).

The bench's figures live in its tied results (bench/results/fleet-model-8-64.*), not here: this keeps its
pipeline working and checks the outcomes that do not depend on the machine's speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_fleet_bench_small_fleet_on_both_backends(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "fleet.py"), "--nodes", "8", "--rest", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"v3", "v2"}
    for backend, row in rows.items():
        assert row["nodes"] == 8 and row["model"] == "agent"
        assert row["errors"] == 0, backend
        assert row["ranks_kept"] is True, backend  # the join kept every old rank
        assert row["spurious_losses"] == 0, backend  # nobody alive was taken for lost
        for key in ("up_to_ranked_s", "loss_known_s", "join_ranked_s", "silent_loss_known_s"):
            assert row[key] is not None, (backend, key)  # every node saw it happen
        # a silent node is known gone only after its TTL (3 s by default), never before
        assert row["silent_loss_known_s"] >= 2.0, backend
    # at rest: v3 keep-alives are no raft proposals; every v2 refresh (5 a second per node) is one
    assert rows["v3"]["rest_proposals_per_node_s"] < 0.1
    assert rows["v2"]["rest_proposals_per_node_s"] > 2.0
    assert rows["v3"]["lost_place"] == 0  # a v3 watch keeps its place (v2's may lose it: 1,000 events)
    assert "| v3 | 8 |" in out.with_suffix(".md").read_text()


def test_fleet_bench_with_the_agents_peer_watch(tmp_path: Path) -> None:
    """`--peer-watch`: the agent's own silence rules on every node. A silent node is dropped by the member
    watching it, long before its TTL (3 s) would, on both backends, and nobody alive is dropped; on v3
    the watch's reads and the keep-alives are still no raft proposals. The nodes are dealt over two shard
    processes (`--procs 2`, how the bench reaches 1000 nodes): the silent node and its watcher are in
    different processes, and the round still ranks all of them. It runs the older read model
    (`--model every-node`: every node watches `live/` throughout), so both models stay working."""
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "fleet.py"), "--nodes", "8", "--rest", "2",
                           "--peer-watch", "--procs", "2", "--model", "every-node", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    for backend, row in rows.items():
        assert row["peer_watch"] is True and row["errors"] == 0 and row["procs"] == 2, backend
        assert row["model"] == "every-node", backend
        assert row["ranks_kept"] is True and row["join_ranked_s"] is not None, backend
        assert row["spurious_losses"] == 0 and row["reasserted"] == 0, backend
        assert 1.0 <= row["silent_loss_known_s"] < 3.0, (backend, row["silent_loss_known_s"])
    assert rows["v3"]["rest_proposals_per_node_s"] < 0.1
    assert "| v3 + peer watch (2 procs), every node watching | 8 |" in out.with_suffix(".md").read_text()
