"""The store-fault benchmark's (P7) figures, read from synthetic node logs with known answers.

The benchmark itself runs real jobs (bench/run.py --scenarios P7); these check that what it reports
(restarts, steps lost, the longest pause, still training) is what the logs say, for the three outcomes it
has to tell apart: training went on untouched, the job restarted from a checkpoint, the job stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import storemetrics
from bench.procs import Node

T = 1000.0  # the fault
STEP = 0.05


def _node(tmp_path: Path, name: str, lines: list[dict], alive: bool = True) -> Node:
    log = tmp_path / f"{name}.log"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)" if alive else "pass"])
    if not alive:
        proc.wait()
    return Node(name, proc, log, T - 100)


def _steps(first: int, last: int, t0: float, restart: int = 0, world: int = 3) -> list[dict]:
    return [{"ts": t0 + i * STEP, "event": "train.step", "step": s, "world_size": world,
             "restart": str(restart)} for i, s in enumerate(range(first, last + 1))]


@pytest.fixture
def nodes(tmp_path):
    made: list[Node] = []

    def make(name: str, lines: list[dict], alive: bool = True) -> Node:
        node = _node(tmp_path, name, lines, alive)
        made.append(node)
        return node

    yield make
    for node in made:
        if node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait()


def test_training_through_the_fault_is_no_restart_and_nothing_lost(nodes):
    run = [nodes(f"n{i}", _steps(0, 499, T - 5)) for i in range(3)]  # 25 s of steps, across the fault
    m = storemetrics.measure(run, "petctl", 3, T, 15.0, T + 20)
    assert m["restarts"] == 0 and m["steps_lost"] == 0 and m["training_after"] is True
    assert m["longest_pause_s"] == pytest.approx(STEP, abs=1e-3)
    assert m["alive"] == {"n0": True, "n1": True, "n2": True} and m["exit_codes"] == {}


def test_a_restart_from_the_checkpoint_counts_one_restart_and_the_steps_redone(nodes):
    # step 105 ran at T + 0.25; the new round (restart 1, round 2) resumes from checkpoint 100 at T + 8
    run = [nodes(f"n{i}", [*_steps(0, 105, T - 5), {"ts": T + 7.5, "event": "workers.started", "round": 2},
                           {"ts": T + 8.0, "event": "train.resume", "step": 100, "world_size": 3},
                           *_steps(100, 400, T + 8.0, restart=1)]) for i in range(3)]
    m = storemetrics.measure(run, "petctl", 3, T, 15.0, T + 20)
    assert m["restarts"] == 1
    assert m["steps_lost"] == 6  # steps 100..105 ran twice
    assert m["longest_pause_s"] == pytest.approx(8.0 - 0.25, abs=1e-3)
    assert m["training_after"] is True


def test_a_job_that_stopped_is_not_training_and_its_loss_is_not_a_number(nodes):
    run = [nodes(f"t{i}", _steps(0, 104, T - 5), alive=(i != 0)) for i in range(3)]
    m = storemetrics.measure(run, "torchrun-etcd-v2", 3, T, 15.0, T + 20)
    assert m["training_after"] is False and m["steps_lost"] is None and m["restarts"] == 0
    assert m["longest_pause_s"] == pytest.approx(20.0 - 0.2, abs=1e-3)  # last step at T + 0.2
    assert m["alive"] == {"t0": False, "t1": True, "t2": True} and m["exit_codes"] == {"t0": 0}


def test_training_at_a_smaller_world_is_not_training_at_the_full_one(nodes):
    run = [nodes(f"n{i}", [*_steps(0, 105, T - 5), *_steps(100, 400, T + 3, restart=1, world=2)])
           for i in range(3)]
    m = storemetrics.measure(run, "petctl", 3, T, 15.0, T + 20)
    assert m["training_after"] is False and m["restarts"] == 1


def test_torchrun_restarts_are_its_own_log_lines_when_no_step_followed(nodes):
    t = float(int(time.time()) - 600)  # glog lines carry no year: parse_glog assumes this one
    run = [nodes(f"t{i}", _steps(0, 104, t - 5)) for i in range(3)]
    with open(run[1].log, "a") as f:  # glog line of a restart, 2 s after the fault (local time)
        lt = time.localtime(t + 2)
        f.write(time.strftime("I%m%d %H:%M:%S.000000 1 api.py:1] ", lt) + "[default] Worker group FAILED. "
                "3/3 attempts left; will restart worker group\n")
    assert storemetrics.system_restarts(run, t, "torchrun-etcd-v2") == 1
    assert storemetrics.system_restarts(run, t + 3, "torchrun-etcd-v2") == 0
    assert storemetrics.measure(run, "torchrun-etcd-v2", 3, t, 15.0, t + 20)["restarts"] == 1
