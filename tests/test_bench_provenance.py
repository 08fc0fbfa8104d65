"""Figures are claims (issue 48): every result file says what code it measured, every committed result is
cited by a document, and README quotes only results tied to a commit, with the numbers in their files."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.support.paths import REPO

RESULTS = REPO / "bench" / "results"


def result_files() -> list:
    return sorted(p for p in RESULTS.iterdir() if p.is_file())


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_a_result_records_its_commit_or_says_it_cannot(path):
    doc = json.loads(path.read_text())
    assert "commit" in doc and "dirty" in doc, f"{path.name}: no commit/dirty (see bench/runmeta.py)"
    if doc["commit"] is None:
        assert doc.get("provenance"), f"{path.name}: commit unknown and no provenance note"


def _cited(name: str) -> bool:
    found = subprocess.run(["git", "grep", "-q", "-F", name, "--", ":!bench/results"], cwd=REPO)
    return found.returncode == 0


def test_every_committed_result_is_cited():
    tracked = set(subprocess.run(["git", "ls-files", "bench/results"], cwd=REPO, capture_output=True,
                                 text=True).stdout.split())
    files = [p for p in result_files() if f"bench/results/{p.name}" in tracked]
    cited_stems = {p.name.split(".")[0] for p in files if _cited(p.name)}
    orphans = [p.name for p in files
               if p.name.split(".")[0] not in cited_stems
               and not any(p.name.startswith(stem + "-") for stem in cited_stems)]
    assert not orphans, f"results no document cites (cite them or delete them): {orphans}"


def readme_results() -> list[str]:
    return re.findall(r"\(bench/results/([\w.-]+\.json)\)", (REPO / "README.md").read_text())


def test_readme_quotes_only_results_tied_to_a_commit():
    cited = readme_results()
    assert cited, "README cites no result file"
    for name in cited:
        doc = json.loads((RESULTS / name).read_text())
        assert doc["commit"] and doc["dirty"] is False, f"README quotes {name}, not tied to a clean commit"


def test_readme_trace_figures_are_the_results():
    """The 'How it compares' table, row by row, against bench/results/spot-trace-handoff.json."""
    readme = (REPO / "README.md").read_text()
    doc = json.loads((RESULTS / "spot-trace-handoff.json").read_text())

    def figure(trace: str, system: str, key: str) -> float:
        return doc["results"][f"{trace}-boot90"]["systems"][system]["summary"]["mean"][key]

    rows = {"every loss announced": "spot-10-15-notice", "a third without notice": "spot-10-15-mixed"}
    for label, trace in rows.items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| {label} |"))
        cells = [c.strip().strip("*") for c in row.strip("|").split("|")]
        assert cells[1] == f"{100 * figure(trace, 'petctl', 'goodput_scaled'):.1f} %", row
        assert cells[2] == f"{100 * figure(trace, 'torchrun-c10d', 'goodput_scaled'):.1f} %", row
        assert cells[3] == f"{figure(trace, 'petctl', 'steps_lost'):.0f}", row
