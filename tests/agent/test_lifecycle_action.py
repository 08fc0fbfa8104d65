"""Completing and heartbeating the ASG termination lifecycle action: right arguments to the API, heartbeats
while a slow checkpoint runs, and failures (moto answers HTTP 500) logged as one line, never raised."""

from __future__ import annotations

import io
import threading
from typing import Any

from petctl.agent.autoscaling import LifecycleHeartbeat, complete_lifecycle_action, make_client
from petctl.core.eventlog import parse_lines
from petctl.io.eventlog import EventLog


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


# --- the launch hook: the agent completes it once registered (petctl/agent/autoscaling.LaunchCompletion) --
def launch_config(tmp_path):
    from petctl.core.spec import AgentConfig, JobSpec

    spec = JobSpec(name="demo", min_size=1, max_size=2, size=1, entrypoint="train.py")
    return AgentConfig(job=spec, node_id="i-0123456789abcdef0", asg_name="petctl-job-demo",
                       lifecycle_hook="petctl-drain", launch_hook="petctl-boot", region="us-east-1",
                       status_url=(tmp_path / "prefix").as_uri() + "/")


def stubbed_autoscaling():
    """A real boto3 autoscaling client whose answers are recorded (botocore's Stubber): the request is
    validated against the service model, so a wrong parameter name or value fails here."""
    import boto3
    from botocore.stub import Stubber

    client = boto3.client("autoscaling", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    return client, Stubber(client)


LAUNCH_ARGS = {"AutoScalingGroupName": "petctl-job-demo", "LifecycleHookName": "petctl-boot",
               "InstanceId": "i-0123456789abcdef0", "LifecycleActionResult": "CONTINUE"}


def run_launch(tmp_path, client, delays=(0.0, 0.0)):
    from petctl.agent.autoscaling import LaunchCompletion
    from petctl.io.objstore import open_object_store

    config = launch_config(tmp_path)
    out = io.StringIO()
    completion = LaunchCompletion(config, EventLog("agent", stream=out), client=client,
                                  store=open_object_store(config.status_url), delays=delays)
    return completion, completion.run(), list(parse_lines(out.getvalue().splitlines()))


def test_launch_hook_completed_with_continue_and_the_boot_recorded_as_joined(tmp_path) -> None:
    from petctl.core.boots import parse_boot_key
    from petctl.core.records import BootRecord

    client, stub = stubbed_autoscaling()
    stub.add_response("complete_lifecycle_action", {}, expected_params=LAUNCH_ARGS)
    with stub:
        completion, ok, events = run_launch(tmp_path, client)
    stub.assert_no_pending_responses()
    assert ok and completion.failures == 0
    (path,) = (tmp_path / "prefix" / "boots").iterdir()
    record = BootRecord.from_json(path.read_text())
    assert (record.instance_id, record.event) == ("i-0123456789abcdef0", "joined")
    assert parse_boot_key(f"boots/{path.name}").event == "joined"
    assert [e["event"] for e in events] == ["lifecycle.launch_completed"]
    assert events[0]["failures"] == 0 and events[0]["recorded"] is True


def test_launch_hook_failure_is_counted_reported_once_and_retried(tmp_path) -> None:
    client, stub = stubbed_autoscaling()
    for _ in range(2):
        stub.add_client_error("complete_lifecycle_action", service_error_code="Throttling",
                              http_status_code=400)
    stub.add_response("complete_lifecycle_action", {}, expected_params=LAUNCH_ARGS)
    with stub:
        completion, ok, events = run_launch(tmp_path, client, delays=(0.0, 0.0, 0.0))
    assert ok and completion.failures == 2
    assert [e["event"] for e in events] == ["lifecycle.launch_failing", "lifecycle.launch_completed"]
    assert "Throttling" in events[0]["error"] and events[1]["failures"] == 2


def test_launch_hook_that_never_completes_gives_up_loudly(tmp_path) -> None:
    client, stub = stubbed_autoscaling()
    for _ in range(3):
        stub.add_client_error("complete_lifecycle_action", service_error_code="InternalFailure",
                              http_status_code=500)
    with stub:
        completion, ok, events = run_launch(tmp_path, client, delays=(0.0, 0.0))
    assert not ok and completion.failures == 3 and completion.recorded
    assert [e["event"] for e in events] == ["lifecycle.launch_failing", "lifecycle.launch_gave_up"]
    assert events[-1]["failures"] == 3


def test_no_pending_launch_action_is_not_a_failure(tmp_path) -> None:
    """An agent restarted on an instance that already completed its hook: AWS says ValidationError."""
    client, stub = stubbed_autoscaling()
    stub.add_client_error("complete_lifecycle_action", service_error_code="ValidationError",
                          service_message="No active Lifecycle Action found with instance ID i-0123",
                          http_status_code=400)
    with stub:
        completion, ok, events = run_launch(tmp_path, client)
    assert ok and completion.failures == 0
    assert [e["event"] for e in events] == ["lifecycle.launch_not_pending", "lifecycle.launch_completed"]


def test_only_an_agent_with_a_launch_hook_completes_one(tmp_path) -> None:
    from petctl.agent.notices import PreemptionHandler

    config = launch_config(tmp_path)
    config.launch_hook = ""  # the local provider
    handler = PreemptionHandler(config, EventLog("agent", stream=io.StringIO()))
    handler.registered()
    assert handler.launch is None and handler.launch_failures == 0
