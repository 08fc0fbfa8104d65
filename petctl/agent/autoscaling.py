"""The instance's Auto Scaling calls: every call the agent makes to its own group, and the end of an instance
that left it, in one place.

Sections:
- the ASG lifecycle actions (the termination hook's heartbeat and completion, the launch hook's);
- the instance's place in its group (`InstancePlace`: `AwsPlace`, `LocalPlace`): at a spot notice it is
  detached, so the group launches its replacement at once, and once the node has left it ends itself;
- releasing capacity (a finished job scales its own group to 0).

All calls are best effort: a failure is an event, never an exception. boto3 is imported only when a call
is made (petctl/io/aws.py, the `agent` profile); tests pass recorders or moto-backed clients instead. The
job role's permissions for these calls are in cfn/job.yaml.j2; tests/aws/test_permissions.py checks that
they allow exactly the calls made here, and tests/aws/test_isolation.py that they reach no other job.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from petctl.agent.health import describe
from petctl.core.boots import boot_key
from petctl.core.records import BootRecord
from petctl.core.spec import AgentConfig
from petctl.io.eventlog import EventLog
from petctl.io.threads import Service

# --- ASG lifecycle actions ----------------------------------------------------------------------------------
# Finishing an Auto Scaling group's lifecycle actions from the instance itself: the termination hook's
# (a drain) and the launch hook's (a boot that worked).
#
# The ASG holds a terminating instance in `Terminating:Wait` until the hook times out or someone completes
# the action. The agent heartbeats the action while its workers checkpoint (so a slow save is not cut off
# at the hook's timeout) and completes it once they are done, so the instance goes (and its replacement
# comes) as soon as possible. Both calls are best effort: a failure is one structured line, never an
# exception, because the instance is going away either way and the agent still has to leave cleanly.
#
# The launch hook holds a new instance (Pending:Wait, not InService) until its agent is registered in the
# rendezvous; `LaunchCompletion` then records the boot as `joined` (petctl/core/boots.py) and completes the
# action with CONTINUE. Not at the first round it is admitted to: with --min 2 a healthy first instance
# waits for a second one, perhaps for a spot shortage's time, and the hook would abandon it meanwhile. Being
# registered already proves the boot end to end: petctl installed and running, the job's code fetched, its
# workers' environment ready, the job's etcd credentials accepted. Those calls are retried in a thread of
# their own (the rendezvous does not wait for them); failures are counted (`failures`, published with the
# node's status) and reported once when they start and once when they end.
#
# The AWS calls go through `LifecycleClient` (a boto3 autoscaling client satisfies it), so tests use a
# recorder: moto answers CompleteLifecycleAction with HTTP 500. boto3 is imported only when needed.

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
        self._service = Service("petctl-lifecycle-heartbeat", self._run)
        self._stop = self._service.stopping
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
        self._service.start()
        return self

    def stop(self) -> None:
        if not self._service.stop(timeout=15):
            self.log.emit("lifecycle.heartbeat_lingered", asg=self.args["AutoScalingGroupName"],
                          instance_id=self.args["InstanceId"])

    def __enter__(self) -> LifecycleHeartbeat:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# Pauses between tries of the launch calls: about four minutes in all, well inside the boot timeout.
LAUNCH_RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0)


class LaunchCompletion:
    """Once the agent is registered: the `joined` boot record, then CONTINUE on the launch hook, each
    retried until it succeeds (see the module doc). `run()` is the whole job; `start()` runs it in a
    thread. `client`/`store` stand in for AWS in tests."""

    def __init__(self, config: AgentConfig, log: EventLog, client: LifecycleClient | None = None,
                 store: Any = None, delays: Sequence[float] = LAUNCH_RETRY_DELAYS) -> None:
        self.config = config
        self.log = log
        self._client = client
        self._store = store
        self.delays = delays
        self.failures = 0  # failed calls, both kinds
        self.recorded = self.completed = False
        self._service = Service("petctl-launch-hook", self.run)
        self._stop = self._service.stopping

    def _record(self) -> None:
        if self._store is None:
            from petctl.io.objstore import open_object_store

            self._store = open_object_store(self.config.status_url)
        record = BootRecord(instance_id=self.config.node_id, event="joined", ts=time.time())
        self._store.put_bytes(boot_key(record), record.to_json().encode(), "application/json")

    def _complete(self) -> None:
        if self._client is None:
            self._client = make_client(self.config.region)
        self._client.complete_lifecycle_action(
            **_args(self.config.asg_name, self.config.launch_hook, self.config.node_id),
            LifecycleActionResult="CONTINUE")

    def _try(self, name: str, call) -> bool:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - botocore errors, credentials, network: counted, retried
            from petctl.io.aws import error_code

            if name == "complete" and error_code(e) == "ValidationError":
                # No pending launch action: this agent was restarted on an instance that already
                # completed it (or the hook timed out): nothing to retry.
                self.log.emit("lifecycle.launch_not_pending", error=describe(e), hook=self.config.launch_hook)
                return True
            self.failures += 1
            if self.failures == 1:
                self.log.emit("lifecycle.launch_failing", step=name, error=describe(e),
                              hook=self.config.launch_hook)
            return False
        return True

    def run(self) -> bool:
        """Both calls until they succeed or the tries run out; True when both succeeded."""
        for delay in (*self.delays, None):
            if self.config.status_url and not self.recorded:
                self.recorded = self._try("record", self._record)
            if not self.completed:
                self.completed = self._try("complete", self._complete)
            if (self.recorded or not self.config.status_url) and self.completed:
                break
            if delay is None or self._stop.wait(delay):
                break
        done = self.completed and (self.recorded or not self.config.status_url)
        self.log.emit("lifecycle.launch_completed" if done else "lifecycle.launch_gave_up",
                      failures=self.failures, recorded=self.recorded, hook=self.config.launch_hook,
                      asg=self.config.asg_name, instance_id=self.config.node_id)
        return done

    def start(self) -> LaunchCompletion:
        self._service.start()
        return self

    def stop(self) -> None:
        if not self._service.stop(timeout=15):
            self.log.emit("lifecycle.launch_lingered", hook=self.config.launch_hook)


# --- the instance's place in its group: detached for a replacement, then ended ------------------------------
# At a spot interruption notice the instance leaves its group without lowering the desired capacity, so the
# group launches its replacement at once; the node keeps training until the hand-off, leaves the rendezvous,
# and then ends its own instance. A scale-in notice (the group's `target-lifecycle-state` = Terminated) is
# never detached: the group wants that instance gone, and the termination hook's path above applies.
#
# What AWS promises, and what the code and tests here rest on:
# - DetachInstances with ShouldDecrementDesiredCapacity=false: "Amazon EC2 Auto Scaling launches instances
#   to replace the ones that are detached" (API reference). The desired capacity is unchanged, so a group
#   at its MaxSize (`--max`) still gets its replacement: the detached instance no longer counts. The same
#   holds for a mixed-instances group: the replacement is chosen by the group's own instance types and
#   allocation strategy, like any launch (it may be another type, or on-demand).
# - Only an InService (or Standby) instance can be detached. One the group is already terminating
#   (Terminating:Wait, e.g. Capacity Rebalancing, which on a two-minute notice "calls the termination
#   lifecycle hook and attempts to launch a replacement immediately") is refused: the detach fails, the
#   group launches that replacement itself, and the termination hook's heartbeat and completion still
#   apply. `detach_for_replacement` then returns False and the caller keeps the hook path.
# - Lifecycle hooks exist for two transitions only, EC2_INSTANCE_LAUNCHING and EC2_INSTANCE_TERMINATING;
#   a detach is neither, so no hook holds it and the termination hook never fires for this instance
#   again. The replacement's launch hook does apply (it joins like any new instance).
# - A detached instance keeps running, and billing, until it ends or is reclaimed ("it continues running
#   and incurring charges"). Ending it is ours to do.
#
# How it ends: by shutting itself down, with no IAM permission at all. The launch template sets
# InstanceInitiatedShutdownBehavior=terminate (an OS shutdown, not `halt`, then terminates the instance),
# and a one-time spot instance, which is what an Auto Scaling group launches, cannot be stopped anyway. The
# agent runs unprivileged (uid 1000 in the job's container, or the `petctl` user on the AMI), so it asks
# the host: it creates `END_REQUEST` in its work directory (the host's /var/lib/petctl/work), and the host's
# `petctl-end-instance.path` unit (worker_image/worker_boot.sh.j2) powers the instance off. The rejected
# alternative, ec2:TerminateInstances on the calling instance only, needs an IAM statement keyed on
# `ec2:SourceInstanceARN`; the shutdown needs none, and the job role keeps no ec2:TerminateInstances. If the
# request is never acted on (a host without the unit), the spot reclaim still ends the instance at the end
# of its notice: the cost of a failure is bounded by the notice window.
#
# IAM: autoscaling:DetachInstances on the job's own group only (cfn/job.yaml.j2, `DetachOwnGroupInstance`).
# IAM has no condition key for the instance ids or for ShouldDecrementDesiredCapacity, so the role could
# detach any instance of its own group, never another job's; the agent detaches only its own instance.

END_REQUEST = "end-instance"  # in the agent's work dir; the host powers off once it exists


class AwsPlace:
    """This instance's place in its Auto Scaling group, for a spot notice's hand-off.

    `detach_for_replacement()` at the notice, `end_instance()` once the node has left the rendezvous.
    Neither raises: each returns whether it did its part and says so in one event (see the section's
    comment for AWS's contract). `autoscaling` stands in for a boto3 client in tests (a recorder or a
    moto-backed client); `end_request` for the host's request file."""

    def __init__(self, config: AgentConfig, events: EventLog, autoscaling: Any = None,
                 end_request: Path | None = None) -> None:
        self.config = config
        self.events = events
        self._autoscaling = autoscaling
        work = Path(config.work_dir or os.getcwd())
        self.end_request = end_request if end_request is not None else work / END_REQUEST
        self.detached = False  # DetachInstances succeeded: the group no longer counts this instance
        self.ended = False  # the end was asked of the host
        self.failures = 0  # failed calls, counted for the node's status

    def _fields(self) -> dict[str, str]:
        return {"asg": self.config.asg_name, "instance_id": self.config.node_id}

    def detach_for_replacement(self) -> bool:
        """Take this instance out of its group without lowering the desired capacity, so the group
        launches a replacement now. True when detached (now or by an earlier call: it is called once,
        a second call makes none); False when it is not an AWS instance in a group, or the call failed
        (`capacity.detach_failed`, counted): the caller then keeps the termination hook's path. Never
        raises."""
        if self.detached:
            return True
        if not (self.config.asg_name and self.config.node_id):
            self.events.emit("capacity.detach_skipped", reason="no Auto Scaling group", **self._fields())
            return False
        try:
            autoscaling = self._autoscaling
            if autoscaling is None:
                from petctl.io.aws import client

                autoscaling = self._autoscaling = client("autoscaling", profile="agent",
                                                         region=self.config.region)
            reply = autoscaling.detach_instances(
                InstanceIds=[self.config.node_id], AutoScalingGroupName=self.config.asg_name,
                ShouldDecrementDesiredCapacity=False)
        except Exception as e:  # noqa: BLE001 - denied, not InService, throttled, no network: a line, not a crash
            from petctl.io.aws import error_code

            self.failures += 1
            self.events.emit("capacity.detach_failed", error=describe(e), code=error_code(e),
                             **self._fields())
            return False
        self.detached = True
        activities = [a.get("ActivityId", "") for a in (reply or {}).get("Activities", [])]
        self.events.emit("capacity.detached", activities=activities, **self._fields())
        return True

    def end_instance(self) -> bool:
        """Once the node has left the rendezvous: end this instance, so it stops billing. Asks the host to
        power off (`END_REQUEST`); the launch template's InstanceInitiatedShutdownBehavior=terminate makes
        that a termination. Only a detached instance ends itself: one still in its group is the group's to
        end (False, `capacity.end_skipped`). False too when the request cannot be written
        (`capacity.end_failed`, counted); True when asked (`capacity.ending`), or asked before. Never
        raises; the host acts within about a second, and the process is stopped with the host."""
        if self.ended:
            return True
        if not self.detached:
            self.events.emit("capacity.end_skipped", reason="not detached: the group ends it",
                             **self._fields())
            return False
        record = json.dumps({"instance_id": self.config.node_id, "asg": self.config.asg_name,
                             "ts": time.time()})
        try:
            partial = self.end_request.with_name(self.end_request.name + ".partial")
            partial.write_text(record + "\n")
            partial.replace(self.end_request)  # whole or not at all: the host acts on its existence
        except OSError as e:
            self.failures += 1
            self.events.emit("capacity.end_failed", error=describe(e), path=str(self.end_request),
                             **self._fields())
            return False
        self.ended = True
        self.events.emit("capacity.ending", path=str(self.end_request), **self._fields())
        return True


# The provider-neutral face of the same idea: one interface, AWS's group and the local reconciler behind it.

class InstancePlace(Protocol):
    """This instance's place in its group (AWS: `AwsPlace`; local: `LocalPlace`). Neither method raises:
    a failure is reported by the implementation and answered False."""

    def detach_for_replacement(self) -> bool: ...

    def end_instance(self) -> bool: ...


class LocalPlace:
    """The local provider's instance: its reconciler plays the group, reached through the instance's own
    metadata endpoint (providers/local/metadata_server.py); the agent process is the instance."""

    def __init__(self, imds_endpoint: str, events: EventLog) -> None:
        self.endpoint = imds_endpoint
        self.events = events

    def detach_for_replacement(self) -> bool:
        from petctl.agent.imds import request_detach

        ok = request_detach(self.endpoint)
        self.events.emit("capacity.detached" if ok else "capacity.detach_failed", provider="local")
        return ok

    def end_instance(self) -> bool:
        """Ask the reconciler to end this detached instance now (`capacity.ending`): its billing stops at
        the request, as an EC2 instance's does once it is shutting down, not when this agent's teardown
        is done. When the request fails (`capacity.end_failed`) the instance still ends when this agent
        exits, which it does next: True either way. Never raises."""
        from petctl.agent.imds import request_end

        if request_end(self.endpoint):
            self.events.emit("capacity.ending", provider="local")
        else:
            self.events.emit("capacity.end_failed", provider="local",
                             error="the local metadata endpoint refused or did not answer; the instance "
                                   "ends when the agent exits")
        return True


def instance_place(config: AgentConfig, events: EventLog) -> InstancePlace | None:
    """This instance's place in its group: AWS's Auto Scaling group where the agent runs in one, the
    local reconciler where a local metadata endpoint stands in for EC2's; None elsewhere."""
    if config.asg_name:
        return AwsPlace(config, events)
    if config.imds_endpoint:
        return LocalPlace(config.imds_endpoint, events)
    return None


# --- releasing capacity -------------------------------------------------------------------------------------
# Give a finished job's capacity back by itself: nobody should pay for idle spot instances overnight.
#
# Run by the one agent that recorded the job's final result (AWS only; `--keep` opts out). In order:
# delete the termination lifecycle hook (otherwise every instance would wait in it for the hook's
# timeout), then drop the Auto Scaling group to 0 (the instances, hence the cost, go now) by setting its
# MinSize and MaxSize to 0: the job's role may call UpdateAutoScalingGroup on its own group only with
# both at 0 (cfn/job.yaml.j2: IAM has condition keys for MinSize and MaxSize, none for DesiredCapacity),
# so job code holding the same credentials can shrink its own group but never grow it. A MaxSize of 0
# takes the desired capacity to 0 with it (AWS: a maximum below the group's size sets the desired
# capacity to it); DesiredCapacity=0 is sent too, which AWS accepts only because it is within [0, 0].
# tests/aws/test_permissions.py checks that the policy allows exactly the calls made here, and
# tests/aws/test_isolation.py evaluates them against the policy's conditions.
#
# The agent does not delete the job stack. Deleting it needs permissions the workers must not hold
# (IAM role deletion, and passing the CloudFormation service role that can do it); an empty group bills
# nothing, and the next CLI command that sees the job's result (`jobs`, `status`, `kill_job`, `teardown`)
# deletes the stack with the base stack's service role. Failures are logged, never raised: the result is
# already recorded, and `petctl kill_job` remains the manual way out.

def release_capacity(asg_name: str, hook_name: str, region: str, log: EventLog,
                     autoscaling: Any = None) -> bool:
    """Remove the group's termination hook, then scale the group to 0. True when both calls succeeded."""
    if autoscaling is None:
        from petctl.io.aws import client

        autoscaling = client("autoscaling", profile="agent", region=region)
    steps = [
        ("delete_lifecycle_hook", lambda: autoscaling.delete_lifecycle_hook(
            AutoScalingGroupName=asg_name, LifecycleHookName=hook_name)),
        ("scale_to_zero", lambda: autoscaling.update_auto_scaling_group(
            AutoScalingGroupName=asg_name, MinSize=0, MaxSize=0, DesiredCapacity=0)),
    ]
    ok = True
    for name, call in steps:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - a missing hook is fine; a denied call is a line, not a crash
            ok = False
            log.emit("release.step_failed", step=name, error=f"{type(e).__name__}: {e}"[:300])
    log.emit("release.done" if ok else "release.partial", asg=asg_name)
    return ok
