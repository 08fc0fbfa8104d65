"""Completing and heartbeating the ASG termination lifecycle action: right arguments to the API, heartbeats
while a slow checkpoint runs, and failures (moto answers HTTP 500) logged as one line, never raised."""

from __future__ import annotations

import io
import threading
from typing import Any

from petctl.agent.lifecycle import LifecycleHeartbeat, complete_lifecycle_action, make_client
from petctl.core.eventlog import EventLog, parse_lines


class Recorder:
    """Stands in for boto3's autoscaling client; records every call, optionally failing."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail
        self.lock = threading.Lock()
        self.beat = threading.Condition(self.lock)

    def _record(self, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.calls.append((name, kwargs))
            self.beat.notify_all()
        if self.fail is not None:
            raise self.fail
        return {}

    def complete_lifecycle_action(self, **kwargs: Any) -> Any:
        return self._record("complete_lifecycle_action", kwargs)

    def record_lifecycle_action_heartbeat(self, **kwargs: Any) -> Any:
        return self._record("record_lifecycle_action_heartbeat", kwargs)

    def wait_for(self, n: int, timeout: float = 10.0) -> bool:
        with self.lock:
            return self.beat.wait_for(lambda: len(self.calls) >= n, timeout)


def events(stream: io.StringIO) -> list[dict]:
    return list(parse_lines(stream.getvalue().splitlines()))


def test_complete_sends_the_right_arguments() -> None:
    rec, stream = Recorder(), io.StringIO()
    ok = complete_lifecycle_action("petctl-job-asg", "petctl-drain", "i-0abc", "eu-west-1", client=rec,
                                   log=EventLog("agent", stream=stream))
    assert ok is True
    assert rec.calls == [("complete_lifecycle_action", {
        "AutoScalingGroupName": "petctl-job-asg", "LifecycleHookName": "petctl-drain",
        "InstanceId": "i-0abc", "LifecycleActionResult": "CONTINUE"})]
    (event,) = events(stream)
    assert event["event"] == "lifecycle.completed" and event["instance_id"] == "i-0abc"


def test_complete_failure_is_logged_not_raised() -> None:
    rec, stream = Recorder(fail=RuntimeError("boom")), io.StringIO()
    ok = complete_lifecycle_action("asg", "hook", "i-1", "us-east-1", result="ABANDON", client=rec,
                                   log=EventLog("agent", stream=stream))
    assert ok is False
    assert rec.calls[0][1]["LifecycleActionResult"] == "ABANDON"
    (event,) = events(stream)
    assert event["event"] == "lifecycle.complete_failed" and "boom" in event["error"]


def test_heartbeat_runs_while_a_slow_save_runs() -> None:
    rec = Recorder()
    save_done = threading.Event()

    def slow_save() -> None:  # a checkpoint that finishes only after three heartbeats went out
        assert rec.wait_for(3)
        save_done.set()

    with LifecycleHeartbeat("asg", "hook", "i-1", "us-east-1", interval=0.05, client=rec) as hb:
        worker = threading.Thread(target=slow_save)
        worker.start()
        worker.join(15)
        assert save_done.is_set()
    n = len(rec.calls)
    assert n >= 3 and hb.beats == n
    assert all(name == "record_lifecycle_action_heartbeat" for name, _ in rec.calls)
    assert rec.calls[0][1] == {"AutoScalingGroupName": "asg", "LifecycleHookName": "hook",
                               "InstanceId": "i-1"}
    assert not rec.wait_for(n + 1, timeout=0.2)  # stopped on exit


def test_heartbeat_failures_are_counted_not_raised() -> None:
    rec, stream = Recorder(fail=OSError("network down")), io.StringIO()
    with LifecycleHeartbeat("asg", "hook", "i-1", "us-east-1", interval=0.05, client=rec,
                            log=EventLog("agent", stream=stream)) as hb:
        assert rec.wait_for(2)
    assert hb.failures >= 2 and hb.beats == 0
    assert {e["event"] for e in events(stream)} == {"lifecycle.heartbeat_failed"}


def test_real_boto3_error_from_moto_is_logged(moto_env: str) -> None:
    """moto answers CompleteLifecycleAction with an error (HTTP 500): one line, no exception."""
    stream = io.StringIO()
    client = make_client("us-east-1", endpoint_url=moto_env)
    ok = complete_lifecycle_action("asg", "hook", "i-1", "us-east-1", client=client,
                                   log=EventLog("agent", stream=stream))
    assert ok is False
    (event,) = events(stream)
    assert event["event"] == "lifecycle.complete_failed"
    with LifecycleHeartbeat("asg", "hook", "i-1", "us-east-1", interval=60, client=client,
                            log=EventLog("agent", stream=stream)) as hb:
        pass
    assert hb.failures == 1
