"""The warm pool's readiness handshake: a pipe of its own, so no output of the worker can break it.

These run real Python processes but preload only small modules of the test's own (not torch), so they
are fast; the agent-level behaviour (a round handed to warm workers) is in test_agent.py.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest

from petctl.agent.workers import WarmPool, WorkerGroup, WorkerSpec
from petctl.io.procs import die_with_parent
from tests.support.paths import REPO

# What a newcomer's machine printed before torch was imported (no numpy), plus a line on stdout that is
# not the ready signal: both streams are written before the worker is ready.
NOISY = '''
import sys, warnings
print("petctl-warm-worker-ready?  not the signal, just output", flush=True)
sys.stderr.write("UserWarning: Failed to initialize NumPy: No module named 'numpy'\\n")
warnings.warn("a warning before the worker is ready")
print("more output on stdout", flush=True)
'''


def make_spec(tmp_path: Path, preload: tuple[str, ...], entrypoint: str = "train",
              nproc: int = 2) -> WorkerSpec:
    (tmp_path / "noisy.py").write_text(NOISY)
    (tmp_path / "dies.py").write_text("import os\nos._exit(3)\n")
    (tmp_path / entrypoint).write_text(
        "import faulthandler, os, sys\nprint('trained rank', os.environ['RANK'], sys.argv[1:])\n"
        "print('faulthandler', faulthandler.is_enabled())\n")
    return WorkerSpec(cmd=[sys.executable, "-u", entrypoint, "--lr", "0.1"], cwd=str(tmp_path), nproc=nproc,
                      base_env={"PYTHONPATH": str(REPO)}, preload=preload)


@pytest.mark.parametrize("fork", [False, True], ids=["spawned", "forked"])
def test_workers_printing_on_both_streams_before_ready_are_seen_ready(tmp_path: Path, fork: bool) -> None:
    """Spawned, each worker prints its imports' output before it is ready; forked, the fork server prints
    it once (it imported once) and it reaches the node log all the same."""
    server_out = io.StringIO()
    pool = WarmPool(make_spec(tmp_path, ("noisy",)), die_with_parent(), fork=fork, out=server_out)
    try:
        assert pool.fill() == 2
        assert pool.forking is fork
        t0 = time.monotonic()
        assert pool.wait_ready(30) == 2
        assert time.monotonic() - t0 < 15  # the real signal, not the deadline
        out = io.StringIO()
        group = WorkerGroup(pool.spec, out, pool=pool)
        group.start(node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=1, restart_count=0,
                    max_restarts=0, run_id="t", extra_env={})
        assert (group.warm_started, group.warm_ready) == (2, 2)
        deadline = time.monotonic() + 30
        while group.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group.stop(1.0) == {0: 0, 1: 0}
        text = out.getvalue()
        # The output printed while waiting is not lost: it reaches the node log after the handoff.
        imports = text if not fork else server_out.getvalue()
        assert imports.count("Failed to initialize NumPy") == (1 if fork else 2)
        assert imports.count("UserWarning: a warning before the worker is ready") == (1 if fork else 2)
        assert "trained rank 0 ['--lr', '0.1']" in text and "trained rank 1 ['--lr', '0.1']" in text
        # A native crash in a worker leaves its threads' Python stacks in the log (PYTHONFAULTHANDLER).
        assert text.count("faulthandler True") == 2
    finally:
        pool.close()


def test_a_worker_that_dies_before_ready_is_reported_at_once_not_after_the_timeout(tmp_path: Path) -> None:
    pool = WarmPool(make_spec(tmp_path, ("dies",), nproc=1), die_with_parent())
    try:
        pool.fill()
        t0 = time.monotonic()
        assert pool.wait_ready(60) == 0
        assert time.monotonic() - t0 < 15
        assert pool.take() is None  # a dead warm worker is never handed out
    finally:
        pool.close()


def test_any_entrypoint_name_is_warm_and_a_full_pool_starts_nothing(tmp_path: Path) -> None:
    """`--entrypoint train` (no .py) used to leave the pool empty forever, and the agent then started a
    readiness reporter on every loop pass."""
    pool = WarmPool(make_spec(tmp_path, ("noisy",), entrypoint="train"), die_with_parent())
    try:
        assert pool.usable
        assert pool.fill() == 2
        assert pool.full
        assert pool.fill() == 0  # nothing to refill, nothing to report
        assert pool.wait_ready(30) == 2
        proc, ready = pool.take() or (None, False)
        assert proc is not None and ready
        assert not pool.full
        assert pool.fill() == 1
        proc.kill()
        proc.wait()
    finally:
        pool.close()


def test_a_spare_per_slot_is_still_warm_after_a_round_takes_its_workers(tmp_path: Path) -> None:
    """PETCTL_WARM_SPARES=1: the node waits for nproc workers, the spares come after; a round takes nproc
    and the next round finds nproc more ready, before any refill."""
    from petctl.agent.workers import warm_spares

    envs = ({}, {"PETCTL_WARM_SPARES": "1"}, {"PETCTL_WARM_SPARES": "x"})
    assert [warm_spares(e) for e in envs] == [0, 1, 0]
    pool = WarmPool(make_spec(tmp_path, ("noisy",)), die_with_parent(), spares=1)
    try:
        assert pool.fill(2) == 2 and not pool.full  # what the node waits for before registering
        assert pool.fill() == 2 and pool.full and pool.fill() == 0
        assert pool.wait_ready(30) == 4
        first = [pool.take() for _ in range(2)]
        assert all(t is not None and t[1] for t in first)
        assert not pool.full and pool.wait_ready(0) == 2  # the next round's, warm already
        for proc, _warm in first:  # type: ignore[misc]
            proc.kill()
            proc.wait()
    finally:
        pool.close()
