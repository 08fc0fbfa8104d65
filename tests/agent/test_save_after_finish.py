"""A save-now request that reaches a node after its workers finished the training (exited 0 with no save
asked) must not turn their exits into a save's: the node reports them done, and nothing re-forms.

The hang behind the old xfail of tests/aws/test_e2e_emulated.py (issue 46): a notice's hand-off (or a
leave's, or an admission's save) landed on the round just after a node's workers printed their last step
and exited 0. The node flagged them anyway, the round runner then read every exit as a save's (neither
success nor failure), the node never reported `workers.succeeded`, and the round it waited for could not
form (the replacement's capacity was not there): the job never ended, billing its instances."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from petctl.agent.savefirst import SaveFirst
from petctl.core.records import Preempt
from petctl.core.spec import JobSpec
from petctl.io import controlfiles

NOTICE = Preempt(node_id="b", deadline=2e9, reason="preemption", leaves=True)


class Workers:
    """The part of a WorkerGroup SaveFirst looks at."""

    def __init__(self, succeeded: bool, running: bool) -> None:
        self._succeeded, self.running = succeeded, running

    def some_succeeded(self) -> bool:
        return self._succeeded

    def signal_all(self, sig: int) -> None:
        raise AssertionError("nobody to signal")


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> None:
        self.seen.append((event, fields))


def saves(tmp_path: Path, workers: Workers) -> tuple[SaveFirst, Events]:
    spec = JobSpec(name="j", min_size=2, max_size=2, size=2, entrypoint="train.py")
    events = Events()
    first = SaveFirst(spec, "a", rdzv=None, preemption=None, events=events, control_dir=tmp_path)
    first.begin(workers)
    return first, events


def on_round(request: Preempt | None) -> SimpleNamespace:
    return SimpleNamespace(round=SimpleNamespace(preempt=request))


def test_a_request_after_the_workers_finished_is_not_flagged_and_they_stay_finished(tmp_path: Path):
    first, events = saves(tmp_path, Workers(succeeded=True, running=False))
    assert first.finished()
    for _ in range(3):  # every pass sees the request: reported once, never flagged
        first.flag(on_round(NOTICE), SimpleNamespace(round=4))
    assert not controlfiles.preempt_path(tmp_path).exists() and not first.flagged
    assert first.finished(), "the round runner would read the workers' exit 0 as a save's"
    assert [e for e, _ in events.seen] == ["save.after_finish"]
    assert events.seen[0][1] == {"round": 4, "noticed": "b", "reason": "preemption"}


def test_a_request_while_the_workers_run_is_flagged_as_before(tmp_path: Path):
    first, events = saves(tmp_path, Workers(succeeded=False, running=True))
    first.flag(on_round(NOTICE), SimpleNamespace(round=4))
    assert controlfiles.preempt_path(tmp_path).exists() and first.flagged and not first.finished()
    assert [e for e, _ in events.seen] == ["preemption.flagged"]
