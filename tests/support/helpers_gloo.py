"""Two real worker processes joined by gloo on loopback, for the multi-rank checkpoint tests.

A worker script starts with `WORKER_PRELUDE` and `run_worker_pair` runs it as ranks 0 and 1: the two
sides of one contract (argv is `mode out`, the rendezvous comes through RANK and MASTER_PORT), kept in one
place so the tests cannot drift apart on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from petctl.agent.workers import torchrun_threads
from petctl.io.procs import free_port
from tests.support.paths import REPO

# Leaves `mode`, `out` (where the worker writes its JSON result), `rank`, `controlfiles` and an initialised
# 2-rank gloo group to the rest of the script.
WORKER_PRELUDE = r'''
import datetime, json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from petctl.io import controlfiles

mode, out = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=60))
'''


def run_worker_pair(tmp_path: Path, worker: str, mode: str, url: str, *, tag: str, timeout: float,
                    rank_env: Callable[[int], dict[str, str]]) -> list[dict]:
    """Run `worker` as ranks 0 and 1, each its own node (control dir tmp_path/control-<rank>), checkpointing
    to `url`; `rank_env(rank)` adds to a rank's environment. Returns what the ranks wrote to
    tmp_path/<tag>-<rank>.json, rank 0 first; a rank that fails fails the test with its output."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    port = free_port()

    def env_of(rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "PETCTL_CHECKPOINT_URL": url,
                "PETCTL_CONTROL_DIR": str(tmp_path / f"control-{rank}"), **rank_env(rank)}

    outs = [tmp_path / f"{tag}-{rank}.json" for rank in range(2)]
    return run_ranks([[sys.executable, str(script), mode, str(out)] for out in outs], env_of, outs, timeout)


def run_ranks(argvs: list[list[str]], env_of: Callable[[int], dict[str, str]], outs: list[Path],
              timeout: float) -> list[dict]:
    """Run one process per rank (`argvs[rank]`, its environment os.environ + `env_of(rank)`), wait for
    them all, and return what each wrote to `outs[rank]` as JSON, rank 0 first. A rank that fails fails
    the test with its output; a rank still running at the end is killed."""
    procs = []
    for rank, argv in enumerate(argvs):
        # PYTHONFAULTHANDLER: a rank that dies in native code shows its threads' stacks in the failure.
        # OMP_NUM_THREADS=1 as torchrun sets it for more than one rank on a host (petctl's agent too).
        env = {"PYTHONFAULTHANDLER": "1", **torchrun_threads(len(argvs), os.environ, {}), **os.environ,
               "PYTHONPATH": str(REPO), **env_of(rank)}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    results = []
    try:
        for proc, out in zip(procs, outs, strict=True):
            output, _ = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, output
            results.append(json.loads(out.read_text()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
