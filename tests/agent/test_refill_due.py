"""When the warm pool refills during a round (`refill_due`), and the low CPU priority a refill imports at.

A refill that waits for the round's first step left a second notice 1.6-2.3 s into a round without a warm
worker (bench P1 --notice-at burst). It now starts when the round forms wherever that cannot slow the
round's own start: the host has a core to spare per import, or the imports yield the CPU and the workers
get their priority back with their orders. The processes here preload small modules of the test's own,
not torch, so they are fast.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import pytest

from petctl.agent.workers import (
    REFILL_AFTER,
    REFILL_NICE,
    Refill,
    RefillLook,
    WarmPool,
    WorkerGroup,
    WorkerSpec,
    can_restore_priority,
    refill,
    refill_due,
)
from petctl.io.eventlog import EventLog
from petctl.io.procs import die_with_parent
from tests.support.paths import REPO


def look(**changes: object) -> RefillLook:
    base = {"missing": 1, "niced": 0, "round_age": 0.0, "step_seen": False, "spare_cores": 0,
            "yielding": False}
    return RefillLook(**{**base, **changes})  # type: ignore[arg-type]


def test_a_full_pool_with_nothing_yielding_does_nothing():
    assert refill_due(look(missing=0, step_seen=True, spare_cores=8, yielding=True,
                           round_age=REFILL_AFTER)) is Refill.WAIT


def test_a_round_just_formed_refills_at_once_and_yields_the_cpu_unless_the_host_has_cores_to_spare():
    assert refill_due(look(spare_cores=1)) is Refill.NOW  # a core for the one import
    assert refill_due(look(spare_cores=4, missing=4)) is Refill.NOW
    assert refill_due(look(spare_cores=1, missing=2, yielding=True)) is Refill.YIELD  # two imports, one core
    assert refill_due(look(missing=0, niced=2, spare_cores=1, yielding=True)) is Refill.YIELD


def test_a_pool_that_forks_refills_at_once_whatever_the_round_or_the_cores():
    """A fork imports nothing: no reason to wait for the round to train, nor to yield the CPU."""
    assert refill_due(look(forking=True, missing=2)) is Refill.NOW
    assert refill_due(look(forking=True, missing=0)) is Refill.WAIT


def test_once_the_round_trains_the_refill_runs_at_the_nodes_priority():
    for trains in ({"step_seen": True}, {"round_age": REFILL_AFTER}):  # the latter: a script with no steps
        assert refill_due(look(yielding=True, **trains)) is Refill.NOW
        assert refill_due(look(missing=0, niced=1, yielding=True, **trains)) is Refill.NOW  # raised back


def test_where_a_priority_cannot_be_raised_back_the_refill_waits_for_the_round_to_train():
    assert refill_due(look(spare_cores=1, missing=2)) is Refill.WAIT
    assert refill_due(look(round_age=REFILL_AFTER - 0.1)) is Refill.WAIT
    assert refill_due(look(step_seen=True)) is Refill.NOW


def test_the_pool_reports_what_it_lacks(tmp_path: Path):
    spec = WorkerSpec(cmd=[sys.executable, "-u", "train.py"], cwd=str(tmp_path), nproc=2)
    pool = WarmPool(spec, None, spares=1, cores=4, yielding=True)
    assert pool.refill_look(1.5, False) == RefillLook(missing=4, niced=0, round_age=1.5, step_seen=False,
                                                      spare_cores=1, yielding=True)
    pool.given_up = True  # every worker died importing: nothing to refill
    assert pool.refill_look(0.0, True).missing == 0
    unusable = WarmPool(WorkerSpec(cmd=[sys.executable, "-m", "mod"], cwd=str(tmp_path), nproc=1), None)
    assert unusable.refill_look(0.0, True).missing == 0


SLOW_IMPORT = "import time\ntime.sleep(float(__import__('os').environ.get('SLOW_IMPORT', '0')))\n"
PRINTS_NICE = "import os\nprint('nice', os.getpriority(os.PRIO_PROCESS, 0), flush=True)\n"


def _spec(tmp_path: Path) -> WorkerSpec:
    (tmp_path / "slowmod.py").write_text(SLOW_IMPORT)
    (tmp_path / "train.py").write_text(PRINTS_NICE)
    return WorkerSpec(cmd=[sys.executable, "-u", "train.py"], cwd=str(tmp_path), nproc=1,
                      base_env={"PYTHONPATH": str(REPO), "SLOW_IMPORT": "3"}, preload=("slowmod",))


def _hand_out(pool: WarmPool) -> tuple[WorkerGroup, io.StringIO]:
    out = io.StringIO()
    group = WorkerGroup(pool.spec, out, pool=pool)
    group.start(node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=1, restart_count=0,
                max_restarts=0, run_id="t", extra_env={})
    return group, out


@pytest.mark.skipif(not can_restore_priority(), reason="this host cannot raise a thread's priority back")
def test_a_refill_imports_at_low_priority_and_a_worker_handed_out_mid_import_gets_its_own_back(tmp_path):
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    pool = WarmPool(_spec(tmp_path), die_with_parent(), yielding=True, fork=False)  # spawned: they import
    try:
        assert pool.fill(nice=REFILL_NICE) == 1
        (proc,) = pool.ready
        time.sleep(0.5)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, ours + REFILL_NICE)  # importing, yielding
        group, out = _hand_out(pool)  # 2.5 s of its import left
        assert (group.warm_started, group.warm_ready) == (1, 0)
        deadline = time.monotonic() + 1.0
        while os.getpriority(os.PRIO_PROCESS, proc.pid) != ours:  # at once, not once its import is done
            assert time.monotonic() < deadline, "the order did not restore the worker's priority"
            time.sleep(0.02)
        assert proc.poll() is None  # still importing
        assert group.wait_exit(30)
        assert f"nice {ours}" in out.getvalue()  # the script trains at the agent's priority
        group.stop(1.0)
    finally:
        pool.close()


@pytest.mark.skipif(not can_restore_priority(), reason="this host cannot raise a thread's priority back")
def test_once_the_round_trains_the_agent_raises_a_pooled_workers_priority(tmp_path: Path):
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    pool = WarmPool(_spec(tmp_path), die_with_parent(), yielding=True, fork=False)  # spawned: they import
    events = EventLog("test")
    try:
        refill(pool, refill_due(pool.refill_look(0.0, False)), 2, events)  # the round just formed: yield
        (proc,) = pool.ready
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, ours + REFILL_NICE)
        assert pool.refill_look(0.5, False).niced == 1
        refill(pool, refill_due(pool.refill_look(0.5, True)), 2, events)  # its first step
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == ours  # still importing, at the node's priority
        assert pool.refill_look(0.6, True).niced == 0
        assert pool.ready == [proc]  # nothing more started
    finally:
        pool.close()


def test_the_first_fill_does_not_yield(tmp_path: Path):
    """The node's first workers are on its join's critical path: they import at its own priority."""
    spec = _spec(tmp_path)
    spec.base_env["SLOW_IMPORT"] = "0"
    pool = WarmPool(spec, die_with_parent(), yielding=True, fork=False)
    try:
        assert pool.fill() == 1
        assert pool.wait_ready(30) == 1
        assert os.getpriority(os.PRIO_PROCESS, pool.ready[0].pid) == os.getpriority(os.PRIO_PROCESS, 0)
        group, out = _hand_out(pool)
        assert group.wait_exit(30)
        assert f"nice {os.getpriority(os.PRIO_PROCESS, 0)}" in out.getvalue()
        group.stop(1.0)
    finally:
        pool.close()


def test_the_low_priority_refill_is_opt_in():
    """Measured on the bench, it slowed a re-formed round's start (bench P1, `--notice-at burst`): not the
    default."""
    from petctl.agent.workers import warm_yield

    assert [warm_yield(e) for e in ({}, {"PETCTL_WARM_YIELD": "1"}, {"PETCTL_WARM_YIELD": "yes"})] == [
        False, True, False]
