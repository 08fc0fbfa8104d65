"""Issue 25, defect 4: a hang is a fault, and a mixed ending never redoes a finished rank's work.

Tables over roundjudge.py's pure rules (no etcd, no clock): running workers without progress past the
watchdog's limit are reported hung once, then restarted like a failure (AskRestart, which the runner
opens with failure=True: counted against --max-restarts); a failure after a rank finished is a mixed
ending that marks the node done and restarts nothing. The watchdog's default: on for a script that
reports progress, only on request (`--timeout hang=SECONDS`) for one that reports none.
"""

from __future__ import annotations

import pytest

from petctl.agent.roundjudge import (
    DEFAULT_HANG,
    AskRestart,
    FailedAfterFinish,
    Idle,
    ReportFailure,
    ReportHang,
    Timing,
    Workers,
    WorkerWatch,
    hang_limit,
    judge_workers,
)
from petctl.cli.parse import timeouts
from petctl.core.errors import ValidationError
from petctl.core.spec import Timeouts

T0 = 1000.0
HANG = Timing(finish_grace=60.0, fail_grace=3.0, hang=30.0)
NO_WATCHDOG = Timing(finish_grace=60.0, fail_grace=3.0)


def workers(**kw) -> Workers:
    base = dict(exited=False, succeeded=False, first_failure=None, some_succeeded=False, running=True,
                round_done_elsewhere=False, saving_now=False, idle=0.0)
    base.update(kw)
    return Workers(**base)


FAILED = dict(exited=True, first_failure=(1, 7), running=False)


@pytest.mark.parametrize(("timeout", "reporting", "limit"), [
    (0.0, True, DEFAULT_HANG),  # a script that reports steps: on by default
    (0.0, False, None),  # one that reports nothing: off unless asked
    (45.0, False, 45.0),
    (45.0, True, 45.0),
])
def test_who_gets_the_watchdog(timeout, reporting, limit):
    assert hang_limit(timeout, reporting) == limit
    # Before the round's first progress: start-up, never cut shorter than the default.
    assert hang_limit(timeout, reporting, progressed=False) == (None if limit is None else
                                                               max(limit, DEFAULT_HANG))


@pytest.mark.parametrize(("case", "look", "watch", "t", "timing", "step"), [
    ("progress within the limit", workers(idle=29.0), WorkerWatch(), HANG, HANG, Idle()),
    ("no progress past the limit: hung", workers(idle=31.0), WorkerWatch(), HANG, HANG, ReportHang(31.0)),
    ("no watchdog: never hung", workers(idle=10**6), WorkerWatch(), HANG, NO_WATCHDOG, Idle()),
    ("a rank finished: the finish grace, not the watchdog", workers(idle=99.0, some_succeeded=True),
     WorkerWatch(), HANG, HANG, Idle()),
    ("saving for a notice: not judged", workers(idle=99.0, saving_now=True), WorkerWatch(), HANG, HANG,
     Idle()),
    ("a failure with no rank finished: reported", workers(**FAILED), WorkerWatch(), HANG, HANG,
     ReportFailure(1, 7)),
    ("a failure after another member finished: a mixed ending, no restart",
     workers(**FAILED, round_done_elsewhere=True), WorkerWatch(failure="f", failed_at=T0), HANG, HANG,
     FailedAfterFinish()),
    ("a failure after our own rank exited 0: a mixed ending",
     workers(**FAILED, some_succeeded=True), WorkerWatch(failure="f", failed_at=T0), HANG, HANG,
     FailedAfterFinish()),
])
def test_worker_steps(case, look, watch, t, timing, step):
    got, _ = judge_workers(watch, look, T0, timing, "n1")
    assert got == step, case


def test_a_hang_is_reported_once_then_restarted_once_as_a_failure():
    watch, steps = WorkerWatch(), []
    for idle in (10.0, 31.0, 32.0, 33.0, 40.0):
        step, watch = judge_workers(watch, workers(idle=idle), T0 + idle, HANG, "n1")
        steps.append(step)
    cause = "hang on n1: workers alive, no progress for 31s"
    assert steps == [Idle(), ReportHang(31.0), AskRestart(cause), Idle(), Idle()]
    assert watch.hung and watch.restart_asked


def test_a_mixed_ending_never_asks_for_a_restart_however_long_it_waits():
    watch, steps = WorkerWatch(), []
    for t, elsewhere in ((0.0, False), (1.0, True), (10.0, True), (20.0, True)):
        step, watch = judge_workers(watch, workers(**FAILED, round_done_elsewhere=elsewhere), T0 + t, HANG,
                                    "n1")
        steps.append(step)
    assert steps == [ReportFailure(1, 7), FailedAfterFinish(), Idle(), Idle()]
    assert watch.finished and not watch.restart_asked


def test_timeout_hang_is_a_timeout_like_the_others():
    assert Timeouts().hang == 0.0  # the default: see hang_limit
    assert timeouts(("hang=120",), Timeouts()).hang == 120.0
    with pytest.raises(ValidationError, match="hang must be > 0"):
        timeouts(("hang=0",), Timeouts())
