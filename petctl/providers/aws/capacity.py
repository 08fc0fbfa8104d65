"""The AWS calls behind a job's placement (the decisions are in placement.py): which AZs offer the
instance types, what the group's scaling activities say, moving the group to another AZ, and suspending
the Auto Scaling processes that would fight a single-AZ training job.
"""

from __future__ import annotations

import json
from typing import Any

from petctl.io.aws import aws_errors
from petctl.providers.aws.placement import Activity

# AZRebalance terminates instances to even out AZs: in a training group that is a lost node for nothing
# (and in a single-AZ group it has nothing to do). CloudFormation's AutoScalingGroup has no property for
# suspended processes (only rolling-update policies suspend them, during updates), so petctl suspends it
# with the API right after creating the group.
SUSPENDED_PROCESSES = ("AZRebalance",)


def offerings(ec2: Any, instance_types: list[str]) -> dict[str, set[str]]:
    """AZ -> the requested instance types offered there (DescribeInstanceTypeOfferings by AZ)."""
    out: dict[str, set[str]] = {}
    with aws_errors("list instance type offerings by availability zone"):
        pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": list(instance_types)}])
        for page in pages:
            for offer in page.get("InstanceTypeOfferings", []):
                out.setdefault(offer["Location"], set()).add(offer["InstanceType"])
    return out


def activities(autoscaling: Any, group: str, limit: int = 20) -> list[Activity]:
    """The group's newest scaling activities, newest first."""
    with aws_errors(f"describe the scaling activities of {group}"):
        raw = autoscaling.describe_scaling_activities(AutoScalingGroupName=group,
                                                      MaxRecords=limit).get("Activities", [])
    return [Activity(status_code=a.get("StatusCode", ""), message=a.get("StatusMessage", ""),
                     description=a.get("Description", ""), az=_activity_az(a.get("Details", "")),
                     start=a["StartTime"].timestamp() if a.get("StartTime") else 0.0) for a in raw]


def _activity_az(details: str) -> str:
    """The AZ in an activity's Details (JSON, e.g. {"Subnet ID": ..., "Availability Zone": ...})."""
    try:
        value = json.loads(details or "{}")
    except ValueError:
        return ""
    return str(value.get("Availability Zone", "")) if isinstance(value, dict) else ""


def suspend_processes(autoscaling: Any, group: str) -> None:
    with aws_errors(f"suspend {', '.join(SUSPENDED_PROCESSES)} on {group}"):
        autoscaling.suspend_processes(AutoScalingGroupName=group, ScalingProcesses=list(SUSPENDED_PROCESSES))


def move_group(autoscaling: Any, group: str, subnet_ids: list[str]) -> None:
    """Point the group at other subnets; Auto Scaling launches its next instances there."""
    with aws_errors(f"move {group} to subnet(s) {', '.join(subnet_ids)}"):
        autoscaling.update_auto_scaling_group(AutoScalingGroupName=group,
                                              VPCZoneIdentifier=",".join(subnet_ids))
