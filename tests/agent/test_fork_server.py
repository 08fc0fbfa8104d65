"""The warm pool's fork server: one interpreter per node imports once and forks every warm worker.

What a user gets from it: a refill that is warm in milliseconds (a second notice early in a round finds a
warm worker), and workers that behave as spawned ones do (exit codes, signals, their own output, their own
random state, death with the agent). Where a fork would be unsafe the pool says why and spawns instead.
The processes here preload small modules of the test's own, not torch, so they are fast.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from petctl.agent.forkserver import ForkedProc, ServerMessage
from petctl.agent.workers import WarmPool, WorkerGroup, WorkerSpec, report_forking
from petctl.io.eventlog import EventLog
from petctl.io.procs import alive as pid_alive
from petctl.io.procs import die_with_parent, wait_until
from tests.support.paths import REPO

# A preload that leaves a mark per import: forked workers share the server's one import.
COUNTED = "import os\nwith open(os.environ['IMPORT_MARKS'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n"
THREADED = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
SCRIPT = """
import gc, os, random, signal, sys, time
print('rank', os.environ['RANK'], 'pid', os.getpid(), 'ppid', os.getppid(), 'random', random.random(),
      'gc', f'{gc.isenabled()}/{gc.get_freeze_count() > 0}', flush=True)
how = os.environ.get('HOW_' + os.environ['RANK'], 'ok')
if how == 'exit3':
    sys.exit(3)
if how == 'raise':
    raise RuntimeError('the script failed')
if how == 'wait':
    time.sleep(60)
"""


def _spec(tmp_path: Path, preload: tuple[str, ...] = ("counted",), nproc: int = 4,
          env: dict[str, str] | None = None) -> WorkerSpec:
    (tmp_path / "counted.py").write_text(COUNTED)
    (tmp_path / "threaded.py").write_text(THREADED)
    (tmp_path / "train.py").write_text(SCRIPT)
    return WorkerSpec(cmd=[sys.executable, "-u", "train.py"], cwd=str(tmp_path), nproc=nproc,
                      base_env={"PYTHONPATH": str(REPO), "IMPORT_MARKS": str(tmp_path / "marks"),
                                **(env or {})}, preload=preload)


def _run(pool: WarmPool, env: dict[str, str]) -> tuple[WorkerGroup, io.StringIO]:
    out = io.StringIO()
    group = WorkerGroup(pool.spec, out, pool=pool)
    group.start(node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=1, restart_count=0,
                max_restarts=0, run_id="t", extra_env=env)
    return group, out


def _lines(out: io.StringIO) -> dict[str, dict[str, str]]:
    """rank -> {pid, ppid, random} from the script's first line."""
    rows = {}
    for line in out.getvalue().splitlines():
        if line.startswith("rank "):
            words = line.split()
            rows[words[1]] = dict(zip(words[2::2], words[3::2], strict=True))
    return rows


def _printed(out: io.StringIO, ranks: int) -> dict[str, dict[str, str]]:
    """The script's first lines, once every rank printed one."""
    wait_until(lambda: len(_lines(out)) == ranks, 10, 0.02)
    return _lines(out)


def test_forked_workers_import_nothing_and_end_as_spawned_ones_do(tmp_path: Path) -> None:
    pool = WarmPool(_spec(tmp_path), die_with_parent())
    try:
        assert pool.fill() == 4 and pool.forking
        assert pool.wait_ready(10) == 4
        server = pool.server
        assert server is not None and server.proc is not None
        # One import, the server's: four workers cost none of their own.
        assert (tmp_path / "marks").read_text().split() == [str(server.proc.pid)]
        assert all(isinstance(p, ForkedProc) for p in pool.ready)
        group, out = _run(pool, {"HOW_1": "exit3", "HOW_2": "raise", "HOW_3": "wait"})
        assert (group.warm_started, group.warm_ready) == (4, 4)
        by_rank = _printed(out, 4)
        assert {r["ppid"] for r in by_rank.values()} == {str(server.proc.pid)}  # the server's children
        assert len({r["random"] for r in by_rank.values()}) == 4  # each its own random state
        # Collections run, but never scan (and so never copy) the pages shared with the server.
        assert {r["gc"] for r in by_rank.values()} == {"True/True"}
        # Ranks 0-2 end by themselves (rank 0 after its line, as `ok`); only rank 3 is left to stop. Waiting
        # for rank 0 too: it printed its line before it exited, and a stop in between ends it by signal.
        wait_until(lambda: all(group.procs[r].poll() is not None for r in (0, 1, 2)), 10, 0.02)
        result = group.poll()
        assert result is not None and result.first_failure() == (1, 3)
        assert group.stop(2.0) == {0: 0, 1: 3, 2: 1, 3: -signal.SIGTERM}  # rank 3 stopped mid-sleep
        assert "RuntimeError: the script failed" in "\n".join(group.error_tail(2))
        assert not any(pid_alive(int(r["pid"])) for r in by_rank.values())
    finally:
        pool.close()


def test_a_refill_is_warm_without_the_import_the_first_fill_waited_for(tmp_path: Path) -> None:
    spec = _spec(tmp_path, nproc=2)
    (tmp_path / "counted.py").write_text(COUNTED + "import time\ntime.sleep(2)\n")  # a slow import
    pool = WarmPool(spec, die_with_parent())
    try:
        t0 = time.monotonic()
        assert pool.fill() == 2 and pool.wait_ready(10) == 2
        assert time.monotonic() - t0 >= 2.0  # the server's import
        group, _out = _run(pool, {})
        assert group.wait_exit(10)
        assert pool.fill() == 2 and pool.wait_ready(10) == 2
        assert len((tmp_path / "marks").read_text().split()) == 1  # warm with no import of its own
        group.stop(1.0)
    finally:
        pool.close()


def test_closing_the_pool_stops_the_server_and_every_worker_it_forked(tmp_path: Path) -> None:
    pool = WarmPool(_spec(tmp_path, nproc=2), die_with_parent())
    pool.fill()
    assert pool.wait_ready(10) == 2
    group, out = _run(pool, {"HOW_0": "wait", "HOW_1": "wait"})
    rows = _printed(out, 2)
    pids = [int(r["pid"]) for r in rows.values()]
    pool.fill()
    pooled = [p.pid for p in pool.ready]
    server = pool.server
    assert server is not None and server.proc is not None
    pool.close()
    assert server.proc.poll() is not None
    assert wait_until(lambda: not any(pid_alive(pid) for pid in pids + pooled), 5, 0.02)
    assert {lr: p.poll() for lr, p in group.procs.items()} == {0: -signal.SIGKILL, 1: -signal.SIGKILL}


def test_a_server_that_dies_reports_its_workers_killed_and_the_pool_spawns_from_then_on(tmp_path: Path):
    pool = WarmPool(_spec(tmp_path, nproc=1), die_with_parent())
    events: list[dict] = []
    log = EventLog("test")
    log.add_sink(events.append)
    try:
        pool.fill()
        assert pool.wait_ready(10) == 1
        (pooled,) = pool.ready
        server = pool.server
        assert server is not None and server.proc is not None
        server.proc.kill()  # the OOM killer, say
        assert pooled.wait(5) == -signal.SIGKILL and not pid_alive(pooled.pid)
        assert pool.fill() == 1  # spawned now
        assert not pool.forking and "fork server" in pool.fork_reason
        assert pool.wait_ready(10) == 1 and not isinstance(pool.ready[0], ForkedProc)
        report_forking(pool, log, 3)
        report_forking(pool, log, 4)  # once, not per refill
        assert [(e["event"], e["round"]) for e in events] == [("workers.fork_server_unavailable", 3)]
    finally:
        pool.close()


def test_a_preload_that_starts_a_thread_makes_the_pool_spawn_and_say_why(tmp_path: Path) -> None:
    """A fork copies only the calling thread: a lock another thread held would stay held in the child."""
    pool = WarmPool(_spec(tmp_path, preload=("threaded", "counted"), nproc=2), die_with_parent())
    try:
        assert pool.fill() == 2
        assert not pool.forking and "threads" in pool.fork_reason
        assert pool.wait_ready(10) == 2
        group, out = _run(pool, {})
        assert group.wait_exit(10) and group.stop(1.0) == {0: 0, 1: 0}
        spawned = {rank: row["gc"] for rank, row in _lines(out).items()}
        assert spawned == {"0": "True/False", "1": "True/False"}  # trained, with nothing frozen
    finally:
        pool.close()


def test_the_job_can_ask_for_spawned_workers() -> None:
    from petctl.agent.workers import warm_fork

    assert [warm_fork(e) for e in ({}, {"PETCTL_WARM_FORK": "0"}, {"PETCTL_WARM_FORK": "1"})] == [
        True, False, True]


@pytest.mark.parametrize("line", [b"{}", b"not json\n", b'{"kind": "other"}', b'{"kind": "hello", "x": 1}'])
def test_a_line_that_is_not_a_server_message_is_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        ServerMessage.parse(line)
    assert ServerMessage.parse(ServerMessage("exited", pid=7, code=-9).line()) == ServerMessage(
        "exited", pid=7, code=-9)


def test_a_forked_worker_dies_with_its_server_even_by_sigkill(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG on the server's children: an agent killed outright leaves no worker behind."""
    pool = WarmPool(_spec(tmp_path, nproc=1), die_with_parent())
    try:
        pool.fill()
        assert pool.wait_ready(10) == 1
        (proc,) = pool.ready
        assert pool.server is not None and pool.server.proc is not None
        os.kill(pool.server.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(proc.pid), 5, 0.02)
    finally:
        pool.close()
