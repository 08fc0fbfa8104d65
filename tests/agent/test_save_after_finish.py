"""A save-now request that reaches a node after its workers finished the training (exited 0 with no save
asked) must not turn their exits into a save's: the node reports them done, and nothing re-forms.

The hang behind the old xfail of tests/aws/test_e2e_emulated.py (issue 46): a notice's hand-off (or a
leave's, or an admission's save) landed on the round just after a node's workers printed their last step
and exited 0. The node flagged them anyway, the round runner then read every exit as a save's (neither
success nor failure), the node never reported `workers.succeeded`, and the round it waited for could not
form (the replacement's capacity was not there): the job never ended, billing its instances.

The other way round too: workers that exited 0 after reporting a save (`saved.<rank>`) exited for a save,
even when no request is on the round as this agent last read it. A noticed node flags its own workers
first (`SaveFirst.flag_own`) and their all-reduce carries the flag to every rank, so that happens whenever
the announcement is slower than a step, or etcd is stalled (the seeded soak's notice in an etcd stall)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from petctl.agent.savefirst import SaveFirst
from petctl.core.records import SaveNow
from petctl.core.spec import JobSpec
from petctl.io import controlfiles

NOTICE = SaveNow(node_id="b", deadline=2e9, reason="preemption", leaves=True)


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
    first.begin(workers, 4)
    return first, events


def on_round(request: SaveNow | None) -> SimpleNamespace:
    return SimpleNamespace(round=SimpleNamespace(save_now=request))


def test_a_request_after_the_workers_finished_is_not_flagged_and_they_stay_finished(tmp_path: Path):
    first, events = saves(tmp_path, Workers(succeeded=True, running=False))
    assert first.finished()
    for _ in range(3):  # every pass sees the request: reported once, never flagged
        first.flag(on_round(NOTICE), SimpleNamespace(round=4))
    assert not controlfiles.save_now_path(tmp_path).exists() and not first.flagged
    assert first.finished(), "the round runner would read the workers' exit 0 as a save's"
    assert [e for e, _ in events.seen] == ["save.after_finish"]
    assert events.seen[0][1] == {"round": 4, "noticed": "b", "reason": "preemption"}


def test_a_request_while_the_workers_run_is_flagged_as_before(tmp_path: Path):
    first, events = saves(tmp_path, Workers(succeeded=False, running=True))
    first.flag(on_round(NOTICE), SimpleNamespace(round=4))
    assert controlfiles.save_now_path(tmp_path).exists() and first.flagged and not first.finished()
    assert [e for e, _ in events.seen] == ["preemption.flagged"]


def test_workers_that_reported_a_save_exited_for_it_with_no_request_seen(tmp_path: Path):
    """Exit 0 after `saved.0`: a save's exit, never the end of the training, whatever the round says."""
    first, events = saves(tmp_path, Workers(succeeded=True, running=False))
    controlfiles.write_saved(tmp_path, 0, 41)
    assert first.workers_saved() and not first.finished()
    first.flag(on_round(NOTICE), SimpleNamespace(round=4))  # the announcement arrives after the exit
    assert [e for e, _ in events.seen] == ["preemption.flagged"] and not first.finished()


def noticed(tmp_path: Path, workers: Workers, protocol: bool = True) -> tuple[SaveFirst, Events]:
    first, events = saves(tmp_path, workers)
    first.preemption = SimpleNamespace(save_deadline=2e9)
    if protocol:
        controlfiles.mark_elastic(tmp_path, 0)
    return first, events


def test_a_noticed_node_flags_its_own_workers_once_a_round_with_no_etcd(tmp_path: Path):
    first, events = noticed(tmp_path, Workers(succeeded=False, running=True))
    assert first.flag_own("backstop") and controlfiles.read_save_now(tmp_path) == {"node_id": "a",
                                                                                   "deadline": 2e9}
    assert not first.flag_own("handoff"), "flagged once a round"
    first.flag(on_round(NOTICE), SimpleNamespace(round=4))  # the round's request, read later: no second flag
    assert events.seen == [("preemption.flagged", {"round": 4, "noticed": "a", "reason": "preemption",
                                                   "source": "backstop"})]
    first.begin(Workers(succeeded=False, running=True), 5)  # a new round: flagged again when due
    assert first.flag_own("handoff") and events.seen[-1][1]["round"] == 5


def test_flag_own_leaves_alone_workers_it_cannot_or_need_not_flag(tmp_path: Path):
    plain, events = noticed(tmp_path / "plain", Workers(succeeded=False, running=True), protocol=False)
    assert not plain.flag_own("handoff")  # a plain script: SIGTERM once the request is on the round
    gone, _ = noticed(tmp_path / "gone", Workers(succeeded=False, running=False))
    assert not gone.flag_own("backstop")  # between rounds: nobody to flag
    done, _ = noticed(tmp_path / "done", Workers(succeeded=True, running=False))
    assert not done.flag_own("backstop")  # the training is over
    assert events.seen == [] and not controlfiles.save_now_path(tmp_path / "gone").exists()
