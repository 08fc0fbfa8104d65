"""bench/drops.py tells a real drop (the node's heartbeat had stopped) from a spurious one (it kept
refreshing and found its key gone), from synthetic node logs with known answers."""

from __future__ import annotations

import json
from pathlib import Path

from bench import drops

T = 1000.0  # the drop


def _log(root: Path, test: str, node: str, lines: list[dict]) -> None:
    path = root / test / node / "agent.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    base = {"component": "agent", "job": "j", "node": node}
    lines = [{"ts": T - 9, "event": "agent.started"}, *lines]
    path.write_text("".join(json.dumps({**base, **line}) + "\n" for line in lines))


def test_each_drop_is_judged_by_the_dropped_nodes_own_log(tmp_path: Path) -> None:
    lost = {"ts": T, "event": "membership.lost", "nodes": ["b"], "round": 1}
    _log(tmp_path, "frozen", "a", [lost])
    _log(tmp_path, "frozen", "b", [{"ts": T + 4, "event": "heartbeat.lost"},
                                   {"ts": T + 4.01, "event": "heartbeat.gap", "seconds": 5.0}])
    _log(tmp_path, "killed", "a", [lost, {**lost, "ts": T + 0.01}])  # declared twice: one drop
    _log(tmp_path, "killed", "b", [])
    _log(tmp_path, "live", "a", [lost])
    _log(tmp_path, "live", "b", [{"ts": T + 0.2, "event": "heartbeat.lost"},
                                 {"ts": T + 0.21, "event": "heartbeat.reasserted"}])
    counts, lines = drops.report([tmp_path])
    assert dict(counts) == {"ok": 2, "SPURIOUS": 1}
    verdicts = {line.split()[1]: line.split()[0] for line in lines if not line.startswith("gap")}
    assert verdicts == {"frozen": "ok", "killed": "ok", "live": "SPURIOUS"}
    assert "gap 5.0 s: frozen j b" in lines  # etcd answered around it: listed
    assert drops.main([str(tmp_path)]) == 1
