"""README's first command must keep working: the demo runs to the end and says the job behaved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import EXAMPLES
from tests.support.procs import processes_with_home

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_demo_passes(tmp_path: Path):
    home = tmp_path / "demo-home"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "demo.py"), "--home", str(home)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "demo passed" in out
    worlds = next(line for line in out.splitlines() if "world sizes seen" in line).split()[3:]
    assert worlds[0] == "2" and worlds[-1] == "3" and "1" in worlds  # shrank, grew back, scaled up
    assert "final state       succeeded" in out
    # The launch -> first step time is printed (how fast is in bench/, not here): a positive number of
    # seconds, measured from the run_job command to the first train.step event.
    launch = next(line for line in out.splitlines() if "launch -> step 0" in line).split()[-1]
    assert launch.endswith("s") and float(launch[:-1]) > 0
    assert processes_with_home(str(home)) == []  # the demo tore everything down
    assert not (home / "local").exists()
