"""Why a job's Auto Scaling group is not filling: its scaling activities, explained in one line each.

Auto Scaling records every launch attempt with a status and, on failure, EC2's reason (a vCPU quota,
`InsufficientInstanceCapacity`, an instance profile IAM has not propagated yet). Without these a
`run_job` that waits only sees "0/4 in service". `explain` is a pure function over the records, so the
hints are tested without AWS; `recent` is the one call (DescribeScalingActivities).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from petctl.io.aws import aws_errors

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
