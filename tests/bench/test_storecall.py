"""bench/storecall.py: one v3 store call's CPU, this tree beside another, in one run."""

from __future__ import annotations

import json
from pathlib import Path

from bench import storecall


def test_a_run_measures_both_trees_and_records_each_ones_commit(tmp_path: Path) -> None:
    """Two trees (here the same checkout twice) take turns; every load has a CPU figure above zero for
    each, and the result names each tree's commit."""
    out = tmp_path / "storecall.json"
    assert storecall.main(["--against", str(storecall.runmeta.REPO), "--calls", "200", "--reps", "1",
                           "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [t["name"] for t in doc["trees"]] == ["this tree", "against"]
    for tree in doc["trees"]:
        assert tree["commit"] == doc["commit"] and len(tree["reps"]) == 1
        assert all(tree["median"][load]["process_ms"] > 0 for load in storecall.LOADS)
    assert "| get | loop_ms |" in out.with_suffix(".md").read_text()


def test_the_table_gives_this_trees_figure_over_the_others() -> None:
    figures = {load: {fig: 1.0 for fig in storecall.FIGURES} for load in storecall.LOADS}
    trees = [{"name": "this tree", "commit": "a" * 40, "dirty": False,
              "median": {**figures, "get": {**figures["get"], "loop_ms": 0.5}}},
             {"name": "against", "commit": "b" * 40, "dirty": True, "median": figures}]
    text = storecall.table(trees)
    assert "this tree (aaaaaaa) | against (bbbbbbb, dirty) | ratio |" in text
    assert "| get | loop_ms | 0.500 | 1.000 | 0.50 |" in text
