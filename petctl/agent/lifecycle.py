"""Finishing an Auto Scaling termination lifecycle action from the instance being terminated.

The ASG holds a terminating instance in `Terminating:Wait` until the hook times out or someone completes
the action. The agent heartbeats the action while its workers checkpoint (so a slow save is not cut off
at the hook's timeout) and completes it once they are done, so the instance goes (and its replacement
comes) as soon as possible. Both calls are best effort: a failure is one structured line, never an
exception, because the instance is going away either way and the agent still has to leave cleanly.

The AWS calls go through `LifecycleClient` (a boto3 autoscaling client satisfies it), so tests use a
recorder: moto answers CompleteLifecycleAction with HTTP 500. boto3 is imported only when needed.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from petctl.agent.outage import describe
from petctl.core.eventlog import EventLog


class LifecycleClient(Protocol):
    """The two autoscaling API calls we make (boto3's method names and keyword arguments)."""

    def complete_lifecycle_action(self, **kwargs: Any) -> Any: ...

    def record_lifecycle_action_heartbeat(self, **kwargs: Any) -> Any: ...


def make_client(region: str, endpoint_url: str | None = None) -> LifecycleClient:
    """A boto3 autoscaling client with few retries (the `agent` profile): the clock is the two-minute
    notice."""
    from petctl.io.aws import client

    return client("autoscaling", profile="agent", region=region, endpoint_url=endpoint_url or "")


def _args(asg_name: str, hook_name: str, instance_id: str) -> dict[str, str]:
    return {"AutoScalingGroupName": asg_name, "LifecycleHookName": hook_name, "InstanceId": instance_id}


def complete_lifecycle_action(asg_name: str, hook_name: str, instance_id: str, region: str,
                              result: str = "CONTINUE", client: LifecycleClient | None = None,
                              log: EventLog | None = None) -> bool:
    """Tell the ASG this instance is done with its hook; True on success, False (logged) on any failure."""
    log = log or EventLog("agent")
    fields = {"asg": asg_name, "hook": hook_name, "instance_id": instance_id, "result": result}
    try:
        client = client or make_client(region)
        client.complete_lifecycle_action(**_args(asg_name, hook_name, instance_id),
                                         LifecycleActionResult=result)
    except Exception as e:  # noqa: BLE001 - botocore errors, missing credentials, no network: never fatal
        log.emit("lifecycle.complete_failed", error=describe(e), **fields)
        return False
    log.emit("lifecycle.completed", **fields)
    return True


class LifecycleHeartbeat:
    """Records a lifecycle-action heartbeat now and every `interval` seconds until stopped.

        with LifecycleHeartbeat(asg, hook, instance_id, region, interval=30):
            wait_for_checkpoint()
    """

    def __init__(self, asg_name: str, hook_name: str, instance_id: str, region: str, interval: float = 30.0,
                 client: LifecycleClient | None = None, log: EventLog | None = None) -> None:
        self.args = _args(asg_name, hook_name, instance_id)
        self.region = region
        self.interval = interval
        self.log = log or EventLog("agent")
        self._client = client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0  # successful heartbeats
        self.failures = 0

    def beat(self) -> bool:
        """One heartbeat; failures are logged and counted, not raised."""
        try:
            if self._client is None:
                self._client = make_client(self.region)
            self._client.record_lifecycle_action_heartbeat(**self.args)
        except Exception as e:  # noqa: BLE001 - as above: counted and logged, the save goes on
            self.failures += 1
            self.log.emit("lifecycle.heartbeat_failed", error=describe(e),
                          asg=self.args["AutoScalingGroupName"], instance_id=self.args["InstanceId"])
            return False
        self.beats += 1
        return True

    def _run(self) -> None:
        while True:
            self.beat()
            if self._stop.wait(self.interval):
                return

    def start(self) -> LifecycleHeartbeat:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="petctl-lifecycle-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=15)

    def __enter__(self) -> LifecycleHeartbeat:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
