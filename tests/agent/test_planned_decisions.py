"""Planned membership changes save first (petctl/agent/roundjudge.py): the admitting node's decisions, as a
table, and when a graceful leave saves first. Pure functions: no etcd, no workers."""

from __future__ import annotations

import pytest

from petctl.agent.roundjudge import Hold, Reform, RequestSave, SaveLook, admission, leave_saves_first
from petctl.core.records import SaveNow

ME, OTHER, WALL, BUDGET = "a", "b", 1000.0, 90.0
CAUSE = "scale-up: c"
OURS = SaveNow(node_id=ME, deadline=WALL + BUDGET, reason=CAUSE, leaves=False)
NOTICE = SaveNow(node_id=OTHER, deadline=WALL + 100, reason="preemption", leaves=True)
THEIR_ADMISSION = SaveNow(node_id=OTHER, deadline=WALL + 50, reason="scale-up: d", leaves=False)
LEAVING_ME = SaveNow(node_id=ME, deadline=WALL + 5, reason="leave", leaves=True)


def look(request=None, protocol=True, running=True, saved=False, finished=False) -> SaveLook:
    return SaveLook(node_id=ME, request=request, protocol=protocol, running=running, saved=saved,
                    finished=finished)


@pytest.mark.parametrize(("case", "seen", "cause", "expected"), [
    ("a waiting node, elastic workers running: save first", look(), CAUSE, RequestSave(OURS)),
    ("a plain torchrun script: re-form at once (SIGTERM)", look(protocol=False), CAUSE, Reform()),
    ("our workers already exited: nothing to save", look(running=False), CAUSE, Reform()),
    ("nobody waiting, no request: nothing to do", look(), None, Hold()),
    ("our request, the save not done yet", look(OURS), CAUSE, Hold()),
    ("our request, saved: re-form", look(OURS, saved=True), CAUSE, Reform()),
    ("our request, saved, the waiting node gone since: re-form anyway", look(OURS, saved=True), None,
     Reform()),
    ("a notice of another node under way: its leave re-forms", look(NOTICE, saved=True), CAUSE, Hold()),
    ("another node's admission: it re-forms", look(THEIR_ADMISSION, saved=True), CAUSE, Hold()),
    ("our own leave under way: the leave re-forms", look(LEAVING_ME, saved=True), CAUSE, Hold()),
    ("our workers finished (exit 0, no save asked): never re-formed for a waiting node",
     look(running=False, finished=True), CAUSE, Hold()),
    ("one of our workers finished, another still exits: hold", look(finished=True), CAUSE, Hold()),
    ("plain script finished: hold", look(protocol=False, running=False, finished=True), CAUSE, Hold()),
    ("our workers finished before our own request reached them: hold, the job ends (issue 46)",
     look(OURS, running=False, saved=True, finished=True), CAUSE, Hold()),
])
def test_admission(case, seen, cause, expected):
    assert admission(seen, cause, WALL, BUDGET) == expected, case


def test_the_request_carries_the_cause_and_nobody_leaves():
    step = admission(look(), CAUSE, WALL, BUDGET)
    assert isinstance(step, RequestSave)
    assert (step.request.reason, step.request.leaves, step.request.deadline) == (CAUSE, False, WALL + BUDGET)


@pytest.mark.parametrize(("seen", "expected"), [
    (look(), True),
    (look(protocol=False), False),  # torchrun's way: SIGTERM
    (look(running=False), False),  # nothing left to save
    (look(NOTICE), True),  # a notice under way saves first anyway
])
def test_a_graceful_leave_saves_first_when_the_workers_can(seen, expected):
    assert leave_saves_first(seen) is expected
