"""The layer rules hold: checked on the real import graph, and on the installed package's metadata.

Why a test: a layer boundary that nothing checks rots one convenient import at a time. The rules live in
.importlinter (core imports nothing of petctl or third-party; io builds only on core; the agent and
petctl.elastic are independent; only petctl.elastic imports torch; only petctl.io imports boto3; no
import loop among the modules of any one package).
"""

from __future__ import annotations

import importlib.metadata
import re
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
    assert "BROKEN" not in run.stdout and run.stdout.count("KEPT") >= 8, run.stdout


def test_import_rules_catch_a_wrong_import(tmp_path: Path) -> None:
    """The checker is live: a core module importing the agent is reported (so a pass above means it)."""
    pytest.importorskip("importlinter", reason="import-linter comes with the test extra")
    run = _lint_fake_tree(tmp_path, {"core/bad.py": "import petctl.agent\n"})
    assert run.returncode != 0
    assert "petctl.core.bad -> petctl.agent" in run.stdout, run.stdout


def test_plain_install_does_not_pull_torch() -> None:
    """`pip install petctl` is the CLI and the agent; torch comes only with an extra (elastic, test)."""
    requires = importlib.metadata.requires("petctl") or []
    torch = [r for r in requires if r.split(";")[0].strip().startswith("torch")]
    assert torch, requires
    assert all("extra ==" in r for r in torch), torch
    assert any('extra == "elastic"' in r for r in torch), torch


LONG = 700  # lines: a module past this is worth a look (one concern, or two?), not a failure


def test_a_long_module_is_flagged_not_failed() -> None:
    """Modules hold one whole concern, however long that takes (docs/ARCHITECTURE.md): a hard cap shaped
    the design more than the design did (code moved only to get under it). A module past LONG lines is
    named in a warning for a reader to judge."""
    import warnings

    for path in sorted((REPO / "petctl").rglob("*.py")):
        lines = path.read_text().count("\n")
        if lines > LONG:
            warnings.warn(f"{path.relative_to(REPO)}: {lines} lines (one concern?)", stacklevel=1)


def test_import_loops_are_caught(tmp_path: Path) -> None:
    """The no-loops contract is live: two sibling modules importing each other are reported."""
    pytest.importorskip("importlinter", reason="import-linter comes with the test extra")
    run = _lint_fake_tree(tmp_path, {"agent/a.py": "from petctl.agent import b\n",
                                     "agent/b.py": "def f():\n    from petctl.agent import a\n"})
    assert run.returncode != 0
    assert "No cycles are allowed in petctl.agent" in run.stdout, run.stdout


def _lint_fake_tree(tmp_path: Path, modules: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """lint-imports with the project's rules over an empty petctl tree plus `modules` (path -> source)."""
    pkg = tmp_path / "petctl"
    for sub in ("core", "io", "agent", "elastic", "jobview", "providers", "cli"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    for path, source in modules.items():
        (pkg / path).write_text(source)
    (tmp_path / ".importlinter").write_text((REPO / ".importlinter").read_text())
    return subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                           "from importlinter.cli import lint_imports_command; lint_imports_command()",
                           "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_the_architecture_map_names_every_module_as_the_tree_has_it() -> None:
    """docs/ARCHITECTURE.md's module index is generated from the tree (tests/support/archmap.py): a module
    added, moved or removed, or a docstring's first sentence changed, without the index regenerated
    fails here, with the command that fixes it."""
    from tests.support import archmap

    doc = archmap.DOC.read_text()
    index = archmap.current(doc)
    assert index is not None, "docs/ARCHITECTURE.md lost its module index markers"
    named, package = set(), None
    for line in index.splitlines():
        if heading := re.match(r"\*\*`(petctl[^`]*)/`\*\*", line):
            package = heading[1]
        elif row := re.match(r"\| `([^`]+\.py)` \|", line):
            named.add(f"{package}/{row[1]}")
    on_disk = {str(p.relative_to(archmap.ROOT)) for p in (archmap.ROOT / "petctl").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert named == on_disk, (f"not in the index: {sorted(on_disk - named)}; gone from the tree: "
                              f"{sorted(named - on_disk)}; run python -m tests.support.archmap --write")
    assert index == archmap.render(), "the module index is stale: run python -m tests.support.archmap --write"
