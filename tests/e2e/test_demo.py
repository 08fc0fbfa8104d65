"""README's first command must keep working: the demo runs to the end and says the job behaved."""

from __future__ import annotations

import os
import shutil
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
    if proc.returncode != 0:  # the demo kept etcd and its logs: keep the logs, stop the rest
        for log in (home / "local").glob("jobs/**/*.log"):
            dest = tmp_path / "kept" / log.relative_to(home / "local")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        subprocess.run([sys.executable, "-m", "petctl", "teardown", "--force"],
                       env={**os.environ, "PETCTL_HOME": str(home)}, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "demo passed" in out
    seen = next(line for line in out.splitlines() if "world sizes seen" in line).split()[3:]
    worlds = [w for w in seen if w != "->"]
    # Shrank to 1, grew back to 2, scaled up to 3, then shrank at the notice (its replacement may join).
    assert worlds[:5] == ["2", "1", "2", "3", "2"] and set(worlds[5:]) <= {"2", "3"}, worlds
    assert "final state       succeeded" in out
    # The launch -> first step time is printed (how fast is in bench/, not here): a positive number of
    # seconds, measured from the run_job command to the first train.step event.
    launch = next(line for line in out.splitlines() if "launch -> step 0" in line).split()[-1]
    assert launch.endswith("s") and float(launch[:-1]) > 0
    assert processes_with_home(str(home)) == []  # the demo tore everything down
    assert not (home / "local").exists()
