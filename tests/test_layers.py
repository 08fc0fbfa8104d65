"""The layer rules hold: checked on the real import graph, and on the installed package's metadata.

Why a test: a layer boundary that nothing checks rots one convenient import at a time. The rules live in
.importlinter (core imports nothing of petctl or third-party; io builds only on core; the agent and
petctl.elastic are independent; only petctl.elastic imports torch; only petctl.io imports boto3).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_import_rules_hold() -> None:
    pytest.importorskip("importlinter", reason="import-linter comes with the test extra")
    run = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()", "--no-cache"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "BROKEN" not in run.stdout and run.stdout.count("KEPT") >= 5, run.stdout


def test_import_rules_catch_a_wrong_import(tmp_path: Path) -> None:
    """The checker is live: a core module importing the agent is reported (so a pass above means it)."""
    pytest.importorskip("importlinter", reason="import-linter comes with the test extra")
    pkg = tmp_path / "petctl"
    for sub in ("core", "io", "agent", "elastic", "jobview", "providers", "cli"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "bad.py").write_text("import petctl.agent\n")
    (tmp_path / ".importlinter").write_text((REPO / ".importlinter").read_text())
    run = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                          "from importlinter.cli import lint_imports_command; lint_imports_command()",
                          "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "petctl.core.bad -> petctl.agent" in run.stdout, run.stdout


def test_plain_install_does_not_pull_torch() -> None:
    """`pip install petctl` is the CLI and the agent; torch comes only with an extra (elastic, test)."""
    requires = importlib.metadata.requires("petctl") or []
    torch = [r for r in requires if r.split(";")[0].strip().startswith("torch")]
    assert torch, requires
    assert all("extra ==" in r for r in torch), torch
    assert any('extra == "elastic"' in r for r in torch), torch


def test_modules_and_classes_stay_small() -> None:
    """One job per module: none over 300 lines, no class over 200 (docs/ARCHITECTURE.md's rule)."""
    import ast

    too_big = []
    for path in sorted((REPO / "petctl").rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines > 300:
            too_big.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200:
                too_big.append(f"{path.relative_to(REPO)}: class {node.name} "
                               f"{node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big
