"""The notice's backstop: just after the last moment that leaves time to save, a noticed node flags its
own workers from a thread of its own, reading only the clock and its measurements, when the round runner
has not flagged them by then.

Why (the seeded soak, tests/e2e/test_soak.py): a spot notice with 7 s of grace, then etcd stalled for
5 s. The round runner sat in an etcd call past the hand-off's last moment, announced after the save
deadline, and the workers were stopped unsaved: the next round redid a step. The workers' all-reduce
needs no etcd, so a flag written locally at the last moment has every rank save the same step.
"""

from __future__ import annotations

import io
import json
import time
from types import SimpleNamespace

from petctl.agent.imds import Notice
from petctl.agent.notices import BACKSTOP_LATE, LEAVE, PreemptionHandler
from petctl.agent.roundjudge import SAVE_SAFETY, SAVE_SLACK
from petctl.core.spec import Timeouts
from petctl.io.eventlog import EventLog

SAVE_S, STEP_S = 0.1, 0.05


class Progress:
    def plan_times(self) -> tuple[tuple[float, ...], float]:
        return (SAVE_S,), STEP_S


def handler() -> tuple[PreemptionHandler, io.StringIO, list[tuple[float, str]]]:
    stream = io.StringIO()
    config = SimpleNamespace(job=SimpleNamespace(timeouts=Timeouts()), imds_endpoint="", node_id="a")
    h = PreemptionHandler(config, EventLog("agent", stream=stream))  # type: ignore[arg-type]
    h.progress = Progress()
    calls: list[tuple[float, str]] = []

    def flag_own(source: str) -> bool:
        calls.append((time.time(), source))
        return len(calls) == 1  # flagged the first time; a no-op after (SaveFirst.flag_own)

    h.flag_own = flag_own
    return h, stream, calls


def events(stream: io.StringIO) -> list[str]:
    return [json.loads(line)["event"] for line in stream.getvalue().splitlines()]


def test_the_backstop_flags_our_workers_at_the_last_moment_and_says_so_once():
    h, stream, calls = handler()
    try:
        h._on_notice(Notice("spot", "terminate", time.time() + 6.0))
        moment = h.last_moment()
        assert moment == h.save_deadline - (SAVE_S * SAVE_SAFETY + SAVE_SLACK) - STEP_S
        assert moment - h.noticed_at > 2.0, "a 6 s notice trains on for a while first"
        while time.time() < moment + BACKSTOP_LATE - 0.1:
            assert not calls, "flagged before the round runner's own chance: two deciders for one moment"
            time.sleep(0.05)
        deadline = time.time() + 5.0
        while not calls and time.time() < deadline:
            time.sleep(0.02)
        assert calls and calls[0][1] == "backstop" and calls[0][0] >= moment + BACKSTOP_LATE
        assert calls[0][0] - moment < BACKSTOP_LATE + 0.5, "flagged long after the last moment"
        time.sleep(0.3)
    finally:
        h.stop()
    assert len(calls) > 1, "it keeps asking (each new round's workers need their flag too)"
    assert events(stream).count("preemption.backstop") == 1


def test_a_graceful_leave_has_no_backstop_it_hands_off_at_once():
    h, stream, calls = handler()
    try:
        h.plan_leave(0.2)  # the save deadline passes at once
        assert h.leaving
        h._on_notice(Notice("spot", "terminate", time.time() + 1.0))  # kept: the leave is already pending
        h._backstop.start()  # as if it ran: the loop itself leaves a leave to the round runner
        time.sleep(0.5)
    finally:
        h.stop()
    assert calls == [] and "preemption.backstop" not in events(stream)
    assert h.notice.kind == LEAVE
