"""Issue 25, defect 6: instance-hours never go down when a job ends.

An instance killed without a word (no `agent.exit`) used to count to `now` while the job ran and to its
last event once the job ended, so `kill_job` lowered the figure (0.31 -> 0.234 in the issue). The local
reconciler's `instance.terminated` ends its span where the instance really ended, running or not.
"""

from __future__ import annotations

import pytest

from petctl.jobview.accounting import account


def ev(ts: float, event: str, **kw) -> dict:
    return {"ts": ts, "event": event, **kw}


# a and b start at 0; b is killed at 20 (its own last word was at 1); a runs until kill_job at 40.
RUNNING = [ev(0, "agent.started", node="a"), ev(0, "agent.started", node="b"),
           ev(1, "workers.started", node="b", round=1, rank=1, world_size=2),
           ev(20, "instance.terminated", instance="b", reason="chaos kill", returncode=-9)]
ENDED = [*RUNNING, ev(40, "agent.exit", node="a"), ev(40.5, "instance.terminated", instance="a")]


@pytest.mark.parametrize("now", [25.0, 35.0, 39.9])
def test_instance_time_never_falls_when_the_job_ends(now):
    running = account(RUNNING, now=now).instance_seconds
    ended = account(ENDED).instance_seconds
    assert running == pytest.approx(now + 20.0)  # a to now; b to its termination, not to now
    assert ended == pytest.approx(40.0 + 20.0)  # a to its exit; b to its termination, not its last word
    assert ended >= running
