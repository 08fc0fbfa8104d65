"""bench/run.py refuses bad arguments with one line and exit 2, before it starts etcd or any node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, says", [
    (["--p5-timeout", "0"], "--p5-timeout must be > 0 seconds"),
    (["--p5-timeout", "-5"], "--p5-timeout must be > 0 seconds"),
    (["--sizes", "8,x"], "--sizes takes comma-separated integers"),
    (["--sizes", "0"], "every node count must be at least 1"),
])
def test_bad_arguments_get_one_line_and_exit_2(argv: list[str], says: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--scenarios", "P5",
                           "--out", str(out), *argv], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
