"""The partition tests' lineage replay (tests/support/partition_checks.py) on made-up ledgers: a resume
may come from a step the survivors completed and the cut-off rank 0 never logged (found in a loaded run of
test_partition_local.py: rank 0 logged step 20, the survivors completed 21 and resumed at 22), but never
from a step nobody in the resumed lineage applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.partition_checks import Outcome


def ledger(rank0_until: int, others_until: int, resume_at: int, then: int) -> list[dict[str, Any]]:
    """Round 1: rank 0 (node v) logs steps 0..rank0_until, ranks 1-2 0..others_until; round 2 resumes
    at `resume_at` on node a (rank 0) and logs up to `then`."""
    ts = iter(float(i) for i in range(10_000))
    events: list[dict[str, Any]] = [
        {"event": "train.resumed", "step": 0, "rank": 0, "node": "v", "ts": next(ts)}]
    for step in range(others_until + 1):
        for rank, node in ((0, "v"), (1, "a"), (2, "b")):
            if rank or step <= rank0_until:
                events.append(
                    {"event": "train.step", "step": step, "rank": rank, "node": node, "ts": next(ts)})
    events.append({"event": "train.resumed", "step": resume_at, "rank": 0, "node": "a", "ts": next(ts)})
    events += [{"event": "train.step", "step": s, "rank": 0, "node": "a", "ts": next(ts)}
               for s in range(resume_at, then + 1)]
    return events


def outcome(events: list[dict[str, Any]]) -> Outcome:
    return Outcome(Path("/nonexistent"), Path("/nonexistent"),
                   lambda name: [e for e in events if e["event"] == name])


def test_a_step_the_survivors_completed_after_rank_0_was_cut_off_is_in_the_lineage():
    lineage, resumes = outcome(ledger(rank0_until=20, others_until=21, resume_at=22, then=30)).final_lineage()
    assert lineage == list(range(31))
    assert [r["step"] for r in resumes] == [0, 22]


def test_a_resume_past_steps_nobody_applied_is_caught():
    with pytest.raises(AssertionError, match="resumed past steps never applied"):
        outcome(ledger(rank0_until=20, others_until=21, resume_at=23, then=30)).final_lineage()


def test_an_earlier_lineages_steps_do_not_count_after_a_resume():
    """Round 1 reached 30, round 2 resumed at 10 and logged to 15: a resume at 20 in round 3 is past
    what the lineage applied, whatever round 1 logged."""
    events = ledger(rank0_until=30, others_until=30, resume_at=10, then=15)
    t = events[-1]["ts"]
    events.append({"event": "train.resumed", "step": 20, "rank": 0, "node": "a", "ts": t + 1})
    with pytest.raises(AssertionError, match="resumed past steps never applied"):
        outcome(events).final_lineage()
