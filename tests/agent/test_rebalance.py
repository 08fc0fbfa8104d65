"""Rebalance recommendations, the fast parts: the IMDS watch (a recommendation is not a preemption), the
local metadata server's answer, the checkpoint request's control files, the agent's responder, the
worker-side request in one process, and the local provider's Capacity Rebalancing decisions."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest

from petctl.agent.imds import IMDSError, IMDSWatcher, Notice, Recommendation
from petctl.agent.rebalance import RebalanceResponder
from petctl.core.errors import PetctlError
from petctl.core.eventlog import parse_lines
from petctl.io import controlfiles as cf
from petctl.io.eventlog import EventLog
from petctl.providers.local.chaos import choose_target
from petctl.providers.local.jobdir import JobDir
from petctl.providers.local.metadata_server import LocalMetadataServer, iso8601
from petctl.providers.local.rebalance import (
    CapacityRebalancer,
    in_service,
    over_max_allowance,
    plan,
    with_replaced,
)
from tests.support.hosts import host
from tests.support.notices import write_notice


def events(stream: io.StringIO, name: str) -> list[dict]:
    return [e for e in parse_lines(stream.getvalue().splitlines()) if e["event"] == name]


# --- the IMDS watch ------------------------------------------------------------------------------------
def test_no_recommendation_is_none(metadata_server: LocalMetadataServer) -> None:
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"))
    assert watcher.check() == (None, None)


def test_recommendation_is_read_and_is_no_notice(metadata_server: LocalMetadataServer) -> None:
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"))
    issued = float(int(time.time()))
    write_notice(metadata_server, "i-1", "rebalance", issued)
    notice, found = watcher.check()
    assert notice is None and isinstance(found, Recommendation)
    assert found.notice_time == issued and found.raw == {"noticeTime": iso8601(issued)}
    assert watcher.poll() is None  # the preemption question alone: nothing pending


def test_recommendation_survives_the_scale_in_that_follows(metadata_server: LocalMetadataServer) -> None:
    """EC2 keeps answering the recommendation after the ASG's scale-in notice; both are seen."""
    (metadata_server.notices_dir).mkdir(parents=True, exist_ok=True)
    (metadata_server.notices_dir / "i-1.json").write_text(json.dumps(
        {"kind": "asg", "time": time.time() + 30, "rebalance": 1000.0}))
    notice, found = IMDSWatcher(metadata_server.endpoint_for("i-1")).check()
    assert notice is not None and notice.kind == "asg"
    assert found is not None and found.notice_time == 1000.0


def test_background_watch_reports_once_and_keeps_watching(metadata_server: LocalMetadataServer) -> None:
    stream = io.StringIO()
    got: list[Recommendation] = []
    notices: list[Notice] = []
    noticed = threading.Event()

    def on_notice(notice: Notice) -> None:
        notices.append(notice)
        noticed.set()

    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"), interval=0.05,
                          log=EventLog("agent", stream=stream))
    watcher.start(on_notice, on_rebalance=got.append)
    try:
        write_notice(metadata_server, "i-1", "rebalance", 1000.0)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # several more polls answer the same recommendation
        assert [r.notice_time for r in got] == [1000.0]
        assert not notices and watcher._service.running
        # The real notice still ends the watch, and the same recommendation is not reported again.
        write_notice(metadata_server, "i-1", "spot", time.time() + 60)
        assert noticed.wait(5)
        time.sleep(0.2)
        assert [n.kind for n in notices] == ["spot"] and len(got) == 1
    finally:
        watcher.stop()
    assert [e["notice_time"] for e in events(stream, "rebalance.recommended")] == [1000.0]


def test_a_new_recommendation_is_reported_again(metadata_server: LocalMetadataServer) -> None:
    got: list[float] = []
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"), interval=0.05)
    watcher.start(lambda n: None, on_rebalance=lambda r: got.append(r.notice_time))
    try:
        for issued in (1000.0, 2000.0):
            write_notice(metadata_server, "i-1", "rebalance", issued)
            deadline = time.monotonic() + 5
            while issued not in got and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(0.2)
    finally:
        watcher.stop()
    assert got == [1000.0, 2000.0]


def test_a_failing_rebalance_callback_is_reported_and_the_watch_goes_on(
        metadata_server: LocalMetadataServer) -> None:
    stream = io.StringIO()
    noticed = threading.Event()

    def broken(_: Recommendation) -> None:
        raise RuntimeError("agent bug")

    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"), interval=0.05,
                          log=EventLog("agent", stream=stream))
    write_notice(metadata_server, "i-1", "rebalance", 1000.0)
    watcher.start(lambda n: noticed.set(), on_rebalance=broken)
    try:
        time.sleep(0.3)
        write_notice(metadata_server, "i-1", "spot", time.time() + 60)
        assert noticed.wait(5)
    finally:
        watcher.stop()
    (failed,) = events(stream, "imds.callback_failed")
    assert failed["callback"] == "on_rebalance" and "agent bug" in failed["error"]


def test_unreadable_recommendation_is_an_outage_not_a_crash(metadata_server: LocalMetadataServer) -> None:
    stream = io.StringIO()
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"), log=EventLog("agent", stream=stream))

    def unreadable() -> Recommendation:
        raise IMDSError("GET rebalance: unreadable recommendation '{torn'")

    watcher._rebalance = unreadable
    assert watcher.check() == (None, None)
    assert watcher.check() == (None, None)
    assert len(events(stream, "imds.unreachable")) == 1


# --- the control files -------------------------------------------------------------------------------
def test_checkpoint_request_round_trip(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert cf.read_checkpoint_request(control) == (0, "") and cf.read_checkpoint_request(None) == (0, "")
    assert cf.request_checkpoint(control, "rebalance") == 1
    assert cf.request_checkpoint(control, "rebalance") == 2  # each request one more than the last
    assert cf.read_checkpoint_request(control) == (2, "rebalance")
    assert cf.answered_checkpoint(control, 0) == 0 and cf.answered_checkpoint(None, 0) == 0
    cf.write_checkpointed(control, 0, 2, 41)
    assert cf.answered_checkpoint(control, 0) == 2 and cf.answered_checkpoint(control, 1) == 0
    assert json.loads((control / "checkpointed.0").read_text()) == {"seq": 2, "step": 41}
    cf.write_save_now(control, "n", 0)
    cf.clear(control, markers=True)  # a new round: the request and its answers stay
    assert not cf.save_now_pending(control)
    assert cf.read_checkpoint_request(control) == (2, "rebalance") and cf.answered_checkpoint(control, 0) == 2
    (control / "checkpoint").write_text("{torn")
    assert cf.read_checkpoint_request(control) == (0, "")
    assert sorted(p.name for p in control.iterdir()) == ["checkpoint", "checkpointed.0"]


def test_responder_writes_one_request_per_recommendation(tmp_path: Path) -> None:
    stream = io.StringIO()
    responder = RebalanceResponder(tmp_path / "control", EventLog("agent", stream=stream))
    responder(Recommendation(1000.0))
    responder(Recommendation(2000.0))
    assert cf.read_checkpoint_request(tmp_path / "control") == (2, "rebalance")
    assert [(e["seq"], e["notice_time"]) for e in events(stream, "checkpoint.requested")] == [(1, 1000.0),
                                                                                             (2, 2000.0)]


def test_responder_reports_an_unwritable_control_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    stream = io.StringIO()
    responder = RebalanceResponder(tmp_path / "file" / "control", EventLog("agent", stream=stream))
    responder(Recommendation(1000.0))  # never raises into the watcher
    assert responder.requests == 0 and len(events(stream, "checkpoint.request_failed")) == 1


# --- the worker side, in one process -------------------------------------------------------------------
class CountingSaves:
    """Wraps a checkpointer's `save` to record the steps handed to it."""

    def __init__(self, ckpt) -> None:
        self.steps: list[int] = []
        inner = ckpt.save

        def save(step, state, block=False):
            self.steps.append(step)
            return inner(step, state, block=block)

        ckpt.save = save


def test_a_request_saves_the_step_at_once_and_training_goes_on(tmp_path: Path, monkeypatch) -> None:
    import torch

    from petctl.elastic import Checkpointer, State
    from petctl.elastic import manifest as mf

    monkeypatch.setenv("LOCAL_RANK", "0")
    control = tmp_path / "control"
    stream = io.StringIO()
    model = torch.nn.Linear(2, 1)
    state = State(model=model, extra={"step": -1})

    def train(ckpt: Checkpointer, steps: range, ask_at: dict[int, str]) -> list[int]:
        saves = CountingSaves(ckpt)
        for step in steps:
            if step in ask_at:
                cf.request_checkpoint(control, ask_at[step])
            state.extra["step"] = step
            assert not ckpt.step_end(step, state)  # never leaves the loop: not a save-now request
        ckpt.wait()
        return saves.steps

    with Checkpointer((tmp_path / "ckpt").as_uri(), keep=10, every=10, control_dir=control,
                      cache_dir=tmp_path / "cache", log=EventLog("elastic", stream=stream)) as ckpt:
        # A request before step 3's check, one at a periodic save's step (saved once), then a new one.
        saved = train(ckpt, range(0, 25), {3: "rebalance", 9: "rebalance", 15: "rebalance"})
        store = ckpt.store
    assert saved == [3, 9, 15, 19]  # 9 is both the request and the periodic save: saved once
    assert [m.step for m in mf.readable_manifests(store, lambda *a: None)] == [19, 15, 9, 3]
    answered = events(stream, "checkpoint.request_answered")
    assert [(e["step"], e["seq"], e["reason"]) for e in answered] == [
        (3, 1, "rebalance"), (9, 2, "rebalance"), (15, 3, "rebalance")]
    assert cf.answered_checkpoint(control, 0) == 3
    assert json.loads((control / "checkpointed.0").read_text()) == {"seq": 3, "step": 15}

    # The next round's worker on this node finds the request answered: no save of its own for it.
    with Checkpointer((tmp_path / "ckpt").as_uri(), every=0, control_dir=control,
                      cache_dir=tmp_path / "cache") as again:
        start = again.resume(state)
        assert start == 20
        assert train(again, range(start, start + 5), {}) == []


def test_check_every_zero_disables_requests(tmp_path: Path, monkeypatch) -> None:
    import torch

    from petctl.elastic import Checkpointer, State

    monkeypatch.setenv("LOCAL_RANK", "0")
    control = tmp_path / "control"
    cf.request_checkpoint(control, "rebalance")
    state = State(model=torch.nn.Linear(2, 1), extra={})
    with Checkpointer((tmp_path / "ckpt").as_uri(), check_every=0, control_dir=control,
                      cache_dir=tmp_path / "cache") as ckpt:
        saves = CountingSaves(ckpt)
        for step in range(5):
            ckpt.step_end(step, state)
    assert saves.steps == [] and cf.answered_checkpoint(control, 0) == 0


def test_a_save_now_save_answers_a_pending_request(tmp_path: Path, monkeypatch) -> None:
    import torch

    from petctl.elastic import Checkpointer, State

    monkeypatch.setenv("LOCAL_RANK", "0")
    control = tmp_path / "control"
    state = State(model=torch.nn.Linear(2, 1), extra={})
    with Checkpointer((tmp_path / "ckpt").as_uri(), control_dir=control,
                      cache_dir=tmp_path / "cache") as ckpt:
        assert not ckpt.step_end(0, state)
        cf.request_checkpoint(control, "rebalance")
        cf.write_save_now(control, "n", time.time() + 60)
        assert ckpt.step_end(1, state)  # the save-now wins: save and leave
    assert cf.read_saved(control) == {0: 1}
    assert json.loads((control / "checkpointed.0").read_text()) == {"seq": 1, "step": 1}


# --- the local provider --------------------------------------------------------------------------------
def test_chaos_rebalance_targets_like_a_notice() -> None:
    hosts = [host("i-a", launched=1), host("i-b", launched=2)]
    noticed = {"i-b": {"kind": "rebalance", "time": 1.0}}
    assert choose_target("j", hosts, {"i-a": 0, "i-b": 1}, noticed, None, "rebalance").host_id == "i-a"
    with pytest.raises(PetctlError, match="already has a rebalance recommendation"):
        choose_target("j", hosts, {"i-a": 0, "i-b": 1}, noticed, "i-b", "rebalance")
    with pytest.raises(PetctlError, match="already has a rebalance recommendation"):
        choose_target("j", hosts, {"i-a": 0, "i-b": 1}, noticed, "i-b", "notice")


def test_over_max_allowance_is_aws_margin() -> None:
    assert [over_max_allowance(d) for d in (1, 3, 9, 10, 25)] == [1, 1, 1, 1, 2]


def test_plan_launches_first_then_retires_once_the_replacement_serves() -> None:
    issued = {"kind": "rebalance", "time": 1.0}
    live = {"i-a", "i-b"}
    first = plan({"i-b": issued}, live, {"i-a": 0, "i-b": 1}, set(), max_size=3, desired=2)
    assert (first.launch, first.retire) == (["i-b"], [])
    waiting = {"i-b": {**issued, "replacement": "i-c"}}
    live = {"i-a", "i-b", "i-c"}
    booting = plan(waiting, live, {"i-a": 0, "i-b": 1}, {"i-a", "i-b", "i-c"}, max_size=3, desired=2)
    assert (booting.launch, booting.retire) == ([], [])  # up, but the job has not grown onto it yet
    grown = plan(waiting, live, {"i-a": 0, "i-b": 1, "i-c": 2}, set(), max_size=3, desired=2)
    assert (grown.launch, grown.retire) == ([], ["i-b"])
    lost = plan(waiting, {"i-a", "i-b"}, {"i-a": 0, "i-b": 1}, set(), max_size=3, desired=2)
    assert (lost.launch, lost.retire) == (["i-b"], [])  # the replacement died: launch another


def test_plan_at_the_jobs_max() -> None:
    """The round is full: the replacement (over max by AWS's margin) serves once its agent is up."""
    ranks = {"i-a": 0, "i-b": 1}
    issued = {"kind": "rebalance", "time": 1.0}
    assert plan({"i-b": issued}, {"i-a", "i-b"}, ranks, set(), max_size=2, desired=2).launch == ["i-b"]
    waiting = {"i-b": {**issued, "replacement": "i-c"}}
    live = {"i-a", "i-b", "i-c"}
    assert plan(waiting, live, ranks, {"i-a", "i-b"}, max_size=2, desired=2).retire == []
    assert plan(waiting, live, ranks, {"i-a", "i-b", "i-c"}, max_size=2, desired=2).retire == ["i-b"]
    # Two at risk at max 2: the margin (one instance) allows one replacement at a time.
    both = {"i-a": {**issued, "time": 0.5}, "i-b": issued}
    assert plan(both, {"i-a", "i-b"}, ranks, set(), max_size=2, desired=2).launch == ["i-a"]
    assert in_service("i-c", {"i-c": 0}, set(), 5) and not in_service("i-c", {}, {"i-c"}, 5)


def test_a_replacement_that_died_is_launched_again_and_named_in_the_notice(tmp_path: Path) -> None:
    """The relaunch path of `plan` (`lost` above), carried out: it once crashed the reconciler (the notice's
    old `replacement` and the new one passed twice to write_notice: TypeError), and the job failed. Found
    by the soak (issue 46) when the replacement of a rebalanced node was lost."""
    from types import SimpleNamespace

    job = JobDir.of(tmp_path, "j")
    job.notices.mkdir(parents=True, exist_ok=True)
    job.write_notice("i-b", "rebalance", 1.0, grace=4.0, replacement="i-c")  # i-c has died since
    launched = iter(["i-d", "i-e"])
    rebalancer = CapacityRebalancer(job, EventLog(io.StringIO()), max_size=3,
                                    launch=lambda _: SimpleNamespace(id=next(launched)),
                                    ranks=lambda: {"i-a": 0, "i-b": 1}, alive=set)
    live = [SimpleNamespace(id="i-a"), SimpleNamespace(id="i-b")]
    rebalancer.tick(live, desired=2, now=10.0)
    assert job.read_notice("i-b") == {"kind": "rebalance", "time": 1.0, "grace": 4.0, "replacement": "i-d"}


def test_a_scale_in_that_takes_a_replacement_takes_its_at_risk_instance_too() -> None:
    """Else the at-risk instance waits for a replacement again: launched, scaled in, every tick (the soak
    saw 240 launches in a minute, issue 46). Replacements of others, and other victims, stay as chosen."""
    assert with_replaced(["i-c"], {"i-b": "i-c"}) == ["i-c", "i-b"]
    assert with_replaced(["i-a"], {"i-b": "i-c"}) == ["i-a"]
    assert with_replaced([], {"i-b": "i-c"}) == []
