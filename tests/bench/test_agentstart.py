"""bench/agentstart.py: an agent's imports with and without the method cache, beside torchrun's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import agentstart


def test_a_run_measures_every_command_with_the_cache_warm(tmp_path: Path) -> None:
    """The run warms the cache as an install does, checks it served every method, and gives each
    command a CPU figure; the record names the commit."""
    out = tmp_path / "agent-start.json"
    assert agentstart.main(["--reps", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for name in agentstart.WARM:
        state = doc["warm_cache_state"][name]
        assert state["compiled"] == 0 and state["hits"] > 100, name
    assert set(doc["rows"]) == set(agentstart.COMMANDS)
    assert all(row["cpu_ms"] > 0 and len(row["cpu_s"]) == 1 for row in doc["rows"].values())
    text = out.with_suffix(".md").read_text()
    assert doc["commit"] and "| agent, warm cache |" in text and "| cli, warm cache |" in text


def test_a_cold_cache_is_refused_not_measured(monkeypatch) -> None:
    """A warm-cache figure taken while the cache compiled would be a cold start under the wrong name."""
    monkeypatch.setitem(agentstart.COMMANDS, "agent, warm cache",
                        "from pathlib import Path; from petctl.io import methodcache; "
                        "methodcache.install('agent', Path('/nonexistent/cache')); "
                        + agentstart.AGENT_IMPORTS)
    env = {"PYTHONPATH": str(agentstart.runmeta.REPO)}
    with pytest.raises(RuntimeError, match="'agent, warm cache' is not warm"):
        agentstart.checked_cache(agentstart.sys.executable, env)


def test_the_table_gives_warm_over_cold_above_the_floor() -> None:
    rows = {name: {"cpu_ms": ms, "cpu_ms_min": ms, "cpu_ms_max": ms, "instructions": ms * 1e6}
            for name, ms in zip(agentstart.COMMANDS, (20.0, 220.0, 120.0, 120.0, 70.0, 2000.0), strict=True)}
    text = agentstart.table(rows, 5)
    assert "| agent, warm cache | 120.0 ms (120.0-120.0) | 120M |" in text
    assert "- agent: warm over cold, CPU above the bare interpreter: 0.50; instructions: 0.55" in text
    assert "- cli: warm over cold, CPU above the bare interpreter: 0.50; instructions: 0.58" in text
