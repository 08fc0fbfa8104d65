"""What a job's capacity looks like from the AWS APIs: AZs, AMIs, the Auto Scaling group and its
instances, and whether the job's etcd answers from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from petctl.core.errors import JobNotFound, ProviderError
from petctl.core.records import JobResult
from petctl.io.aws import aws_errors, error_code
from petctl.providers.base import HostInfo, JobInfo

EC2_STATES = {"pending": "pending", "running": "running", "shutting-down": "terminating",
              "stopping": "terminating", "stopped": "terminated", "terminated": "terminated"}
STACK_STATES = {"CREATE_IN_PROGRESS": "running", "CREATE_COMPLETE": "running", "UPDATE_COMPLETE": "running",
                "UPDATE_IN_PROGRESS": "running", "DELETE_IN_PROGRESS": "killed"}


def usable_azs(session) -> list[str]:
    """Standard AZs that are available (not Local/Wavelength zones, not impaired)."""
    with aws_errors("list availability zones"):
        zones = session.client("ec2").describe_availability_zones(
            Filters=[{"Name": "state", "Values": ["available"]}])["AvailabilityZones"]
    return [z["ZoneName"] for z in zones if z.get("ZoneType", "availability-zone") == "availability-zone"]


def ssm_parameter(ssm, name: str) -> str:
    """AWS's public parameter for the current AMI (resolved now, so the template names a fixed image)."""
    from petctl.io.aws import ClientError

    with aws_errors(f"read SSM parameter {name}"):
        try:
            return ssm.get_parameter(Name=name)["Parameter"]["Value"]
        except ClientError as exc:
            if error_code(exc) == "ParameterNotFound":
                raise ProviderError(f"AMI parameter {name} does not exist in this region: pass "
                                    "--option worker_ami=ami-... / etcd_ami=ami-...") from None
            raise


def group(autoscaling, asg_name: str, job: str) -> dict[str, Any]:
    with aws_errors(f"describe the Auto Scaling group of job {job}"):
        groups = autoscaling.describe_auto_scaling_groups(
            AutoScalingGroupNames=[asg_name])["AutoScalingGroups"]
    if not groups:
        raise JobNotFound(f"no job {job!r} (see `petctl jobs`)")
    return groups[0]


def start_group(autoscaling, asg_name: str, min_size: int, size: int) -> None:
    """Raise a job's group from the 0 it was created at (cfn/job.yaml.j2) to its --min/--size.

    The stack is complete by then whatever EC2 can deliver, so a capacity shortage never rolls it back."""
    with aws_errors(f"start the Auto Scaling group {asg_name}"):
        autoscaling.update_auto_scaling_group(AutoScalingGroupName=asg_name, MinSize=min_size,
                                              DesiredCapacity=size)


def wait_launched(autoscaling, asg_name: str, size: int, timeout: float, poll: float,
                  progress: Callable[[str], None],
                  on_short: Callable[[int], None] | None = None) -> int:
    """Wait until EC2 has launched `size` instances for the group; returns how many it has. Launched, not
    InService: the launch lifecycle hook holds each instance (Pending:Wait) until its agent has joined
    the rendezvous, which `run_job --wait` follows from the boot records (boots.py); this wait is about
    capacity. A spot shortage is reported, not fatal: the group keeps trying, and the job runs as soon
    as `min` nodes are up. Each new scaling activity that did not succeed is reported with EC2's reason
    (quota, capacity, IAM propagation). `on_short(launched)` runs at each poll that finds the group short
    (the AZ fallback hooks in there)."""
    from petctl.providers.aws import activities
    from petctl.providers.aws.boots import launched

    deadline = time.monotonic() + timeout
    last = -1
    seen: set[str] = set()
    while True:
        count = len(launched(group(autoscaling, asg_name, asg_name)))
        if count != last:
            progress(f"instances launched: {count}/{size}")
            last = count
        for activity in reversed(activities.recent(autoscaling, asg_name)):
            if activity.activity_id not in seen:
                seen.add(activity.activity_id)
                if activity.status != "Successful":
                    progress(f"  scaling activity {activities.explain(activity)}")
        if count >= size:
            return count
        if on_short is not None:
            on_short(count)
        if time.monotonic() > deadline:
            progress(f"only {count}/{size} instances launched after {timeout:.0f}s (spot capacity may be "
                     "short); the Auto Scaling group keeps trying (`petctl status` shows why)")
            return count
        time.sleep(poll)


def hosts(ec2, stack: str, job: str) -> list[HostInfo]:
    """The job's instances, terminated ones included while EC2 still lists them (about an hour)."""
    filters = [{"Name": "tag:petctl:stack", "Values": [stack]}, {"Name": "tag:petctl:job", "Values": [job]}]
    out = []
    with aws_errors(f"list the instances of job {job}"):
        for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                for i in reservation["Instances"]:
                    launched = i.get("LaunchTime")
                    out.append(HostInfo(
                        host_id=i["InstanceId"], state=EC2_STATES.get(i["State"]["Name"], i["State"]["Name"]),
                        instance_type=i.get("InstanceType", ""),
                        az=i.get("Placement", {}).get("AvailabilityZone", ""),
                        market="spot" if i.get("InstanceLifecycle") == "spot" else "on-demand",
                        private_ip=i.get("PrivateIpAddress", ""),
                        launched_at=launched.timestamp() if launched else None))
    return sorted(out, key=lambda h: (h.state == "terminated", h.launched_at or 0, h.host_id))


ENDED = ("succeeded", "failed", "killed")


def ended(result: JobResult | None) -> bool:
    """True when a job's result.json records its end (written by its agent, or by kill_job)."""
    return result is not None and result.state in ENDED


def apply_result(info: JobInfo, result: JobResult | None) -> JobInfo:
    """Whenever result.json exists it decides the job's state: a job that succeeded stays succeeded while
    (or after) its stack is deleted, even if that deletion fails."""
    if result is not None and result.state:
        info.state, info.reason = result.state, result.reason
        info.extra["ended_at"] = result.ts
    return info


def job_info(autoscaling, stack: dict[str, Any], provider: str) -> JobInfo:
    tags = {t["Key"]: t["Value"] for t in stack.get("Tags", [])}
    name = tags.get("petctl:job", stack["StackName"])
    status = stack["StackStatus"]
    state = STACK_STATES.get(status, "failed" if "FAILED" in status or "ROLLBACK" in status else "unknown")
    min_size = max_size = desired = 0
    if state == "running":
        try:
            g = group(autoscaling, stack["StackName"], name)
            min_size, max_size, desired = g["MinSize"], g["MaxSize"], g["DesiredCapacity"]
        except JobNotFound:  # the group is created a few seconds into the stack
            pass
    created = stack.get("CreationTime")
    return JobInfo(name=name, state=state, min_size=min_size, max_size=max_size, desired=desired,
                   created_at=created.timestamp() if created else 0.0, provider=provider,
                   reason=stack.get("StackStatusReason", "") if state == "failed" else "",
                   extra={"stack": stack["StackName"], "stack_status": status})


def etcd_answers(endpoint: str, timeout: float) -> bool:
    """True when etcd itself answers at `endpoint` (a TCP connect is not enough: proxies accept those)."""
    from petctl.io.etcd import etcd_healthy

    return etcd_healthy(endpoint, timeout=timeout)
