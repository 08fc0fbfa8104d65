"""Process handles: a recorded pid is only ours while its start time matches, so a stale handle never
signals a stranger; group signals reach workers even after their leader died."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from petctl.io.procs import ProcRef, group_alive, stop_group, wait_gone

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_handle_with_another_start_time_is_not_ours():
    proc = subprocess.Popen(SLEEP)
    try:
        ref = ProcRef.of(proc.pid)
        assert ref.alive() and not ref.frozen()
        stranger = ProcRef(proc.pid, (ref.start or 0) + 1)  # same pid, different process
        assert not stranger.alive()
        assert not stranger.signal(signal.SIGKILL) and not stranger.signal_group(signal.SIGKILL)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert not ref.alive()


def test_freeze_shows_and_stop_group_takes_the_whole_group():
    # A leader in its own session with a child, like an agent and its worker.
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"subprocess.Popen({SLEEP!r}); time.sleep(60)"], start_new_session=True)
    ref = ProcRef.of(leader.pid)
    try:
        time.sleep(0.5)
        ref.signal_group(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not ref.frozen():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stop_group(ref, grace=0.5)  # thaws, SIGTERMs the leader, SIGKILLs the group
        leader.wait(timeout=5)
        deadline = time.monotonic() + 5
        while group_alive(leader.pid):  # the child went too
            assert time.monotonic() < deadline, "a member of the group survived"
            time.sleep(0.05)
        assert wait_gone([ref], 1.0)
    finally:
        ref.signal_group(signal.SIGKILL)
        if leader.poll() is None:
            leader.kill()
            leader.wait()
