"""What a job's capacity looks like from the AWS APIs, and how it is doing: the AZs and AWS's public AMI
parameters, the Auto Scaling group and its instances, why the group is not filling, how its instances
boot, and whether the job's etcd answers from here. Everything here reads; nothing changes a job but
raising its group once its stack exists (`start_group`).

Why the group is not filling: Auto Scaling records every launch attempt with a status and, on failure,
EC2's reason (a vCPU quota, `InsufficientInstanceCapacity`, an instance profile IAM has not propagated
yet). Without these a `run_job` that waits only sees "0/4 in service". `explain` is a pure function over
the records, so the hints are tested without AWS; `recent` is the one call (DescribeScalingActivities).

How the instances boot, for `status` and `run_job --wait`: the boot script and the agent write
`BootRecord`s to `boots/` in the job's prefix (worker_image/boot_record.sh.j2, petctl/agent/notices.py);
the rule that stops a job whose boots never join is petctl/core/boots.py, applied on the instances
themselves. Here they are only read (`report`): the listing (stages and the breaker's view), the newest
failure's record (its error and boot log lines), and the group's instances that wrote nothing yet
(`launching`). `boot_settings` is what the boot script needs to write them.

What each instance was billed (`billed`, for status, report and jobs): from its LaunchTime to its end,
the earliest of the time in EC2's StateTransitionReason and the group's terminating activity. EC2 lists
a terminated instance for about an hour and the group's activities go with the group (kill_job), so an
instance neither still records is counted from its agent's life instead (jobview/accounting.py).
"""

from __future__ import annotations

import re
import time
from calendar import timegm
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from petctl.core.boots import BREAKER_LIMIT, BootReport, breaker, parse_boot_key, stages
from petctl.core.errors import JobNotFound, ProviderError
from petctl.core.records import BootRecord, JobResult, WireFormatError
from petctl.core.spec import AgentConfig, Timeouts
from petctl.io.aws import aws_errors, error_code
from petctl.jobview.accounting import BilledSpan
from petctl.providers.aws.storage import JobStore, job_prefix
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
    the rendezvous, which `run_job --wait` follows from the boot records (`report`); this wait is about
    capacity. A spot shortage is reported, not fatal: the group keeps trying, and the job runs as soon
    as `min` nodes are up. Each new scaling activity that did not succeed is reported with EC2's reason
    (quota, capacity, IAM propagation). `on_short(launched)` runs at each poll that finds the group short
    (the AZ fallback hooks in there)."""
    deadline = time.monotonic() + timeout
    last = -1
    seen: set[str] = set()
    while True:
        count = len(launched(group(autoscaling, asg_name, asg_name)))
        if count != last:
            progress(f"instances launched: {count}/{size}")
            last = count
        for activity in reversed(recent(autoscaling, asg_name)):
            if activity.activity_id not in seen:
                seen.add(activity.activity_id)
                if activity.status != "Successful":
                    progress(f"  scaling activity {explain(activity)}")
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


# --- what each instance was billed --------------------------------------------------------------------
# EC2's StateTransitionReason for a stopped/terminated instance: "User initiated (2026-11-21 06:13:00 GMT)"
_TRANSITION_TIME = re.compile(r"\((\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) (?:GMT|UTC)\)")
_LAUNCHING = re.compile(r"^Launching a new EC2 instance: (i-[0-9a-f]+)")
_TERMINATING = re.compile(r"^Terminating EC2 instance: (i-[0-9a-f]+)")
ACTIVITY_PAGES = 10  # DescribeScalingActivities pages read (100 records each): a job's whole history


def transition_time(reason: str) -> float | None:
    """The time in an EC2 StateTransitionReason, or None."""
    found = _TRANSITION_TIME.search(reason or "")
    return float(timegm(time.strptime(found.group(1), "%Y-%m-%d %H:%M:%S"))) if found else None


def _ts(value: Any) -> float | None:
    return value.timestamp() if hasattr(value, "timestamp") else None


def billed_spans(instances: Iterable[dict[str, Any]],
                 activities: Iterable[dict[str, Any]]) -> list[BilledSpan]:
    """Each instance's billed span from DescribeInstances records (`instances`) and the group's scaling
    activities: launched at its LaunchTime (or its launch activity's start, once EC2 no longer lists it),
    ended at the earliest of the time in its StateTransitionReason and its terminating activity's end;
    still running (None) while EC2 says pending or running. A detached instance leaves the group's
    activities but ends itself through EC2: its transition time ends it."""
    launches: dict[str, float] = {}
    ends: dict[str, float] = {}
    for a in activities:
        description = str(a.get("Description", ""))
        if (m := _LAUNCHING.match(description)) and (start := _ts(a.get("StartTime"))) is not None:
            launches[m.group(1)] = min(start, launches.get(m.group(1), start))
        elif (m := _TERMINATING.match(description)) and a.get("StatusCode") == "Successful" \
                and (end := _ts(a.get("EndTime"))) is not None:
            ends[m.group(1)] = min(end, ends.get(m.group(1), end))
    out: dict[str, BilledSpan] = {}
    for i in instances:
        iid = i["InstanceId"]
        launched = _ts(i.get("LaunchTime")) or launches.get(iid)
        if launched is None:
            continue
        state = i.get("State", {}).get("Name", "")
        if state in ("pending", "running"):
            end = None
        else:
            found = [t for t in (transition_time(i.get("StateTransitionReason", "")), ends.get(iid)) if t]
            end = min(found) if found else None
        out[iid] = BilledSpan(iid, launched, end, instance_type=i.get("InstanceType", ""),
                              market="spot" if i.get("InstanceLifecycle") == "spot" else "on-demand",
                              az=i.get("Placement", {}).get("AvailabilityZone", ""))
    for iid, launched in launches.items():  # gone from EC2's listing (about an hour after it ended)
        if iid not in out and iid in ends:
            out[iid] = BilledSpan(iid, launched, ends[iid])
    return sorted(out.values(), key=lambda b: (b.launched_at, b.instance))


def billed(ec2, autoscaling, stack: str, job: str, asg_name: str) -> list[BilledSpan]:
    """What the job's instances were billed (`billed_spans`), read from DescribeInstances and
    DescribeScalingActivities. A group already deleted has no activities: the instances EC2 still lists
    count alone. Raises ProviderError when EC2 does not answer."""
    filters = [{"Name": "tag:petctl:stack", "Values": [stack]}, {"Name": "tag:petctl:job", "Values": [job]}]
    instances: list[dict[str, Any]] = []
    with aws_errors(f"list the instances of job {job}"):
        for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                instances.extend(reservation["Instances"])
    activities: list[dict[str, Any]] = []
    try:
        with aws_errors(f"read the scaling activities of {asg_name}"):
            pages = autoscaling.get_paginator("describe_scaling_activities").paginate(
                AutoScalingGroupName=asg_name, PaginationConfig={"MaxItems": ACTIVITY_PAGES * 100})
            for page in pages:
                activities.extend(page.get("Activities", []))
    except ProviderError:
        activities = []  # the group is gone (kill_job): what EC2 still lists is the record
    return billed_spans(instances, activities)


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


# (substring of EC2's status message, what it means for the user); the first match wins.
SPOT_QUOTA = ("spot vCPU quota reached: request an increase in Service Quotas "
              "(`petctl doctor --provider aws` shows the quota)")
HINTS = (
    ("Max spot instance count exceeded", SPOT_QUOTA),
    ("MaxSpotInstanceCountExceeded", "spot vCPU quota reached: request an increase in Service Quotas "
                                     "(`petctl doctor --provider aws` shows the quota)"),
    ("VcpuLimitExceeded", "vCPU quota reached: request an increase in Service Quotas "
                          "(`petctl doctor --provider aws` shows the quota)"),
    ("InsufficientInstanceCapacity", "AWS has no capacity for this type in this AZ right now: the group "
                                     "keeps trying (other --instance-type choices widen the pool)"),
    ("SpotMaxPriceTooLow", "the spot price is above the maximum price"),
    ("Invalid IAM Instance Profile", "the job's instance profile is still propagating in IAM: the group "
                                     "retries by itself"),
    ("iamInstanceProfile", "the job's instance profile is still propagating in IAM: the group retries by "
                           "itself"),
    ("UnfulfillableCapacity", "no capacity for this type right now: the group keeps trying"),
)


@dataclass(frozen=True)
class Activity:
    """One scaling activity as DescribeScalingActivities reports it."""

    activity_id: str
    status: str  # Successful | Failed | Cancelled | InProgress | PendingSpotBidPlacement | ...
    description: str
    message: str = ""
    started: float | None = None

    @property
    def failed(self) -> bool:
        return self.status in ("Failed", "Cancelled")


def from_api(record: dict[str, Any]) -> Activity:
    start = record.get("StartTime")
    return Activity(activity_id=str(record.get("ActivityId", "")), status=str(record.get("StatusCode", "")),
                    description=str(record.get("Description", "")),
                    message=str(record.get("StatusMessage", "")),
                    started=start.timestamp() if hasattr(start, "timestamp") else None)


def hint(message: str) -> str:
    """What a status message means for the user ("" when it is not one petctl recognises)."""
    for needle, meaning in HINTS:
        if needle.lower() in message.lower():
            return meaning
    return ""


def explain(activity: Activity) -> str:
    """One line: status, what was attempted, EC2's own reason, and the hint when there is one."""
    line = f"{activity.status}: {activity.description}"
    if activity.message:
        line += f" - {activity.message}"
    meaning = hint(activity.message)
    line = " ".join(line.split())  # EC2's messages may span lines; this is one
    return f"{line} ({meaning})" if meaning else line


def recent(autoscaling, asg_name: str, limit: int = 10) -> list[Activity]:
    """The group's latest activities, newest first. Raises ProviderError (one line) on an AWS error."""
    with aws_errors(f"read the scaling activities of {asg_name}"):
        records = autoscaling.describe_scaling_activities(AutoScalingGroupName=asg_name,
                                                          MaxRecords=limit).get("Activities", [])
    return [from_api(r) for r in records]


# An instance the group has while it launches (Pending, held in the launch hook) or runs: capacity EC2
# delivered, whether or not its boot has joined yet.
LAUNCHED_STATES = ("Pending", "Pending:Wait", "Pending:Proceed", "InService")


def boot_settings(config: AgentConfig) -> dict[str, Any]:
    """What the boot script's records and breaker need (worker_image/boot_record.sh.j2)."""
    url = config.status_url
    bucket, _, prefix = url[len("s3://"):].partition("/") if url.startswith("s3://") else ("", "", "")
    return {"bucket": bucket, "prefix": prefix.rstrip("/") or job_prefix(config.job.name),
            "job": config.job.name, "asg": config.asg_name, "launch_hook": config.launch_hook,
            "timeout": int(config.job.timeouts.boot_timeout), "limit": BREAKER_LIMIT}


def launched(group: dict[str, Any]) -> list[str]:
    """The group's instances that EC2 launched (see LAUNCHED_STATES)."""
    return [i["InstanceId"] for i in group.get("Instances", []) if i.get("LifecycleState") in LAUNCHED_STATES]


def boot_timeout(store: JobStore) -> float:
    """The job's `Timeouts.boot_timeout` (job.json), or the default for a job that does not say."""
    spec = store.get_json("job.json")
    timeouts = spec.get("timeouts") if isinstance(spec, dict) else None
    return Timeouts.from_dict(timeouts if isinstance(timeouts, dict) else {}).boot_timeout


def report(store: JobStore, group: dict[str, Any] | None, now: float | None = None) -> BootReport:
    """The job's boots as of `now`. Raises ProviderError when the prefix cannot be read."""
    marks = [m for key in store.list_keys("boots") if (m := parse_boot_key(key)) is not None]
    verdict = breaker(marks, time.time() if now is None else now, boot_timeout(store))
    failures = sorted((m for m in marks if m.event == "failed"), key=lambda m: (m.ts, m.instance_id))
    last = None
    if failures:
        newest = failures[-1]
        data = store.get_bytes(f"boots/{newest.ts:010d}.{newest.instance_id}.failed.json")
        try:
            last = BootRecord.from_json(data.decode("utf-8", "replace")) if data else None
        except WireFormatError:  # a record cut short: the listing still says it failed
            last = BootRecord(instance_id=newest.instance_id, event="failed", ts=newest.ts,
                              error="(its boot record is not readable)")
    joined = sorted({m.instance_id for m in marks if m.event == "joined"})
    return BootReport(stages(marks, launched(group) if group else ()), verdict, last, joined)
