"""Issue 43 on AWS: what each instance of a job was billed, from EC2's LaunchTime and the end EC2 and the
Auto Scaling group record (StateTransitionReason, the terminating activity), not from its agent's life.

moto records no scaling activities, so the activities' part is checked on records shaped as AWS returns
them; the rest (instances, tags, detach, terminations, transition times) runs on the emulator."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest

from petctl.jobview.accounting import BilledSpan, account
from petctl.providers.aws.inventory import billed, billed_spans, transition_time
from tests.support.aws.account import REGION


def t(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def instance(iid: str, launched: float, state: str, reason: str = "") -> dict:
    return {"InstanceId": iid, "LaunchTime": t(launched), "State": {"Name": state},
            "StateTransitionReason": reason, "InstanceType": "g5.xlarge", "InstanceLifecycle": "spot",
            "Placement": {"AvailabilityZone": "us-east-1a"}}


def activity(description: str, start: float, end: float | None, status: str = "Successful") -> dict:
    record = {"Description": description, "StartTime": t(start), "StatusCode": status}
    if end is not None:
        record["EndTime"] = t(end)
    return record


def test_transition_time_reads_ec2s_reason() -> None:
    assert transition_time("User initiated (2026-11-21 06:13:00 GMT)") == t(0).replace(
        year=2026, month=11, day=21, hour=6, minute=13).timestamp()
    assert transition_time("Service initiated (2026-11-21 06:13:00 UTC)") is not None
    assert transition_time("") is None and transition_time("Client.UserInitiatedShutdown") is None


def test_each_instance_is_billed_from_its_launch_to_its_end() -> None:
    reclaimed = "Server.SpotInstanceTermination (2026-01-01 00:02:10 GMT)"
    base = datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()
    instances = [instance("i-0a", base, "running"),
                 instance("i-0b", base + 5, "terminated", reclaimed),  # the group saw it 20 s later
                 instance("i-0c", base + 8, "terminated", "User initiated (2026-01-01 00:03:00 GMT)"),
                 instance("i-0d", base + 9, "shutting-down")]
    activities = [activity("Launching a new EC2 instance: i-0b", base + 1, base + 40),
                  activity("Terminating EC2 instance: i-0b", base + 130, base + 150),
                  activity("Detaching EC2 instance: i-0c", base + 60, base + 61),  # then ends itself
                  activity("Launching a new EC2 instance: i-0e", base - 600, base - 560),  # EC2 forgot it
                  activity("Terminating EC2 instance: i-0e", base - 300, base - 290),
                  activity("Terminating EC2 instance: i-0d", base + 100, None, "InProgress"),
                  activity("Launching a new EC2 instance: i-0f", base + 200, None, "InProgress")]
    spans = {b.instance: b for b in billed_spans(instances, activities)}
    assert spans["i-0a"] == BilledSpan("i-0a", base, None, "g5.xlarge", "spot", "us-east-1a")
    assert (spans["i-0b"].launched_at, spans["i-0b"].ended_at) == (base + 5, base + 130)  # the earliest end
    assert (spans["i-0c"].launched_at, spans["i-0c"].ended_at) == (base + 8, base + 180)
    assert spans["i-0d"].ended_at is None  # shutting down, no time known yet: billed on to now
    assert (spans["i-0e"].launched_at, spans["i-0e"].ended_at) == (base - 600, base - 290)
    assert "i-0f" not in spans  # not launched yet (not in EC2's list, no end): nothing billed
    # The reclaimed spot instance's 125 s are billed, though its agent lived only from +95 to +120.
    events = [{"ts": base + 95, "event": "agent.started", "node": "i-0b"},
              {"ts": base + 120, "event": "agent.left", "node": "i-0b"}]
    acc = account(events, billed=[spans["i-0b"]])
    assert acc.instance_seconds == pytest.approx(125.0) and acc.billing_basis == "provider"


def test_billed_reads_ec2_and_the_group_on_the_emulator(moto: str) -> None:
    import boto3

    name = "b" + uuid.uuid4().hex[:8]
    stack, job, group = f"petctl-{name}", "train", f"petctl-{name}-job-train"
    ec2 = boto3.client("ec2", endpoint_url=moto, region_name=REGION)
    autoscaling = boto3.client("autoscaling", endpoint_url=moto, region_name=REGION)
    ami = ec2.describe_images()["Images"][0]["ImageId"]
    ec2.create_launch_template(LaunchTemplateName=f"{group}-lt",
                               LaunchTemplateData={"ImageId": ami, "InstanceType": "g5.xlarge"})
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=group, LaunchTemplate={"LaunchTemplateName": f"{group}-lt"}, MinSize=0,
        MaxSize=3, DesiredCapacity=2, AvailabilityZones=[f"{REGION}a"],
        Tags=[{"Key": "petctl:stack", "Value": stack, "PropagateAtLaunch": True},
              {"Key": "petctl:job", "Value": job, "PropagateAtLaunch": True}])
    first = sorted(i["InstanceId"] for i in autoscaling.describe_auto_scaling_groups(
        AutoScalingGroupNames=[group])["AutoScalingGroups"][0]["Instances"])
    # The noticed instance detaches itself (desired kept: the group launches its replacement), then ends
    # itself through EC2.
    autoscaling.detach_instances(InstanceIds=[first[0]], AutoScalingGroupName=group,
                                 ShouldDecrementDesiredCapacity=False)
    ec2.terminate_instances(InstanceIds=[first[0]])
    spans = {b.instance: b for b in billed(ec2, autoscaling, stack, job, group)}
    assert first[0] in spans and len(spans) == 3  # the detached one, the other, the replacement
    assert spans[first[0]].ended_at is not None and spans[first[0]].ended_at >= spans[first[0]].launched_at
    running = [b for b in spans.values() if b.ended_at is None]
    assert len(running) == 2 and all(b.instance_type == "g5.xlarge" for b in spans.values())
    # A deleted group (kill_job) has no activities any more: what EC2 still lists is the record.
    autoscaling.delete_auto_scaling_group(AutoScalingGroupName=group, ForceDelete=True)
    assert {b.instance for b in billed(ec2, autoscaling, stack, job, group)} == set(spans)
