"""P6 `petctl --help` cold start: wall time of a fresh interpreter printing the CLI's help.

Median of several runs of `python -m petctl --help` (and of the `petctl` console script when installed),
with `torchrun --help` measured the same way for reference. Each run is a new process: what a user feels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import phases
from bench.petctl_runner import REPO, node_env
from bench.scenarios.common import Context


def time_command(cmd: list[str], runs: int) -> dict[str, Any]:
    times: list[float] = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=120)
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"error": f"exit code {proc.returncode}: {proc.stdout.decode(errors='replace')[-300:]}"}
        times.append(elapsed)
    return {"seconds": phases.summarize(times), "runs": [round(t, 4) for t in times]}


def run(ctx: Context) -> dict[str, Any]:
    runs = 3 if ctx.quick else 11
    out: dict[str, Any] = {"title": "petctl --help cold start", "runs_each": runs, "commands": {}}
    commands = {"python -m petctl --help": [sys.executable, "-m", "petctl", "--help"]}
    # Console scripts are installed beside the interpreter: found there even when its environment is not
    # activated (a bench run as venv/bin/python), so the anchor is never silently left out.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    script = shutil.which("petctl", path=path)
    if script:
        commands["petctl --help"] = [script, "--help"]
    commands["python -c pass (interpreter floor)"] = [sys.executable, "-c", "pass"]
    trun = shutil.which("torchrun", path=path)
    if trun:
        commands["torchrun --help (reference)"] = [trun, "--help"]
    for label, cmd in commands.items():
        ctx.log(f"P6 {label} x{runs}")
        out["commands"][label] = time_command(cmd, runs)
    return out
