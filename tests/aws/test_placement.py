"""One AZ per job (cross-AZ all-reduce is billed per GB), chosen where the instance types are offered,
with a fallback to the next AZ when capacity cannot be had; AZRebalance suspended on every job group.

The decisions are pure functions (tested on records); the provider's calls are tested against moto, with
the scaling activities that moto cannot produce (capacity failures) injected at the one function that
reads them."""

from __future__ import annotations

import json

import pytest

from petctl.core.errors import ProviderError
from petctl.core.spec import JobSpec
from petctl.providers.aws import capacity
from petctl.providers.aws.capacity import (
    Activity,
    Placement,
    capacity_failure,
    decide_fallback,
    plan_placement,
    rank_azs,
)
from tests.support.aws.account import all_stacks, boto, submit, write_script

SUBNETS = {"us-east-1a": "subnet-a", "us-east-1b": "subnet-b", "us-east-1c": "subnet-c"}
NO_CAPACITY = Activity("Failed", "We currently do not have sufficient g5.xlarge capacity in the Availability "
                       "Zone you requested (us-east-1a). InsufficientInstanceCapacity")


# --- pure decisions ---------------------------------------------------------------------------------
def test_rank_prefers_azs_offering_every_type_then_by_name():
    offers = {"us-east-1a": {"g5.xlarge"}, "us-east-1b": {"g5.xlarge", "g6.xlarge"},
              "us-east-1c": {"g5.xlarge", "g6.xlarge"}, "us-east-1d": {"g5.xlarge", "g6.xlarge"}}
    ranked = rank_azs(offers, SUBNETS, ["g5.xlarge", "g6.xlarge"])
    # us-east-1d has no subnet in the base stack; 1a offers only one of the two types: last
    assert [(c.az, c.subnet_id, c.offered) for c in ranked] == [
        ("us-east-1b", "subnet-b", 2), ("us-east-1c", "subnet-c", 2), ("us-east-1a", "subnet-a", 1)]
    assert [c.az for c in rank_azs(offers, SUBNETS, ["g5.xlarge", "g6.xlarge"], tried={"us-east-1b"})] == [
        "us-east-1c", "us-east-1a"]


def test_rank_refuses_when_no_az_offers_the_types():
    with pytest.raises(ProviderError, match="none offers them"):
        rank_azs({"us-east-1a": {"g5.xlarge"}}, SUBNETS, ["p5.48xlarge"])
    with pytest.raises(ProviderError, match="all were tried"):
        rank_azs({az: {"g5.xlarge"} for az in SUBNETS}, SUBNETS, ["g5.xlarge"], tried=set(SUBNETS))


def test_capacity_failure_reads_only_the_newest_decided_activity():
    ok = Activity("Successful", "")
    pending = Activity("InProgress", "")
    bad_ami = Activity("Failed", "The image id '[ami-1]' does not exist")
    spot = Activity("Failed", "Could not launch Spot Instances. UnfulfillableCapacity - Unable to fulfill "
                              "capacity due to your request configuration.")
    assert capacity_failure([pending, NO_CAPACITY, ok]) == NO_CAPACITY
    assert capacity_failure([spot]) == spot
    assert capacity_failure([ok, NO_CAPACITY]) is None  # it recovered since
    assert capacity_failure([bad_ami]) is None  # another AZ would not fix a bad AMI
    assert capacity_failure([]) is None
    # after a move: failures from before it, or from the AZ it left, are not about the new AZ
    old = Activity("Failed", NO_CAPACITY.message, az="us-east-1a", start=100.0)
    assert capacity_failure([old], az="us-east-1b", since=50.0) is None
    assert capacity_failure([Activity("Failed", NO_CAPACITY.message, start=100.0)], since=200.0) is None
    assert capacity_failure([old, NO_CAPACITY], az="us-east-1a", since=50.0) == old


def test_fallback_moves_to_the_next_untried_az_and_stops_at_the_last():
    placement = Placement(azs=["us-east-1a", "us-east-1b"], subnets=["subnet-a", "subnet-b"])
    move = decide_fallback(placement, [NO_CAPACITY], in_service=0, desired=2)
    assert (move.move, move.az, move.subnet_id) == (True, "us-east-1b", "subnet-b")
    assert "us-east-1a" in move.reason and "InsufficientInstanceCapacity" in move.reason
    assert not decide_fallback(placement, [NO_CAPACITY], in_service=2, desired=2).move  # not short
    assert not decide_fallback(placement, [Activity("Successful", "")], in_service=0, desired=2).move
    placement.current = 1
    last = decide_fallback(placement, [NO_CAPACITY], in_service=0, desired=2)
    assert not last.move and "no AZ left" in last.reason and "us-east-1a, us-east-1b" in last.reason
    spread = Placement(azs=["us-east-1a", "us-east-1b"], subnets=["subnet-a", "subnet-b"], multi_az=True)
    assert not decide_fallback(spread, [NO_CAPACITY], in_service=0, desired=2).move


def test_placement_record_round_trips_and_names_its_subnets():
    offers = {az: {"g5.xlarge"} for az in SUBNETS}
    placement = plan_placement(offers, SUBNETS, ["g5.xlarge"])
    assert (placement.az, placement.subnet_ids) == ("us-east-1a", ["subnet-a"])
    assert Placement.from_dict(json.loads(placement.to_json())) == placement
    spread = plan_placement(offers, SUBNETS, ["g5.xlarge"], multi_az=True)
    assert spread.subnet_ids == ["subnet-a", "subnet-b", "subnet-c"]


# --- against moto -----------------------------------------------------------------------------------
def job(name: str = "demo", **kw) -> JobSpec:
    return JobSpec(name=name, min_size=1, max_size=4, size=2, entrypoint="", **kw)


def asg(moto: str, name: str) -> dict:
    return boto(moto, "autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=[name])["AutoScalingGroups"][0]


def subnet_az(moto: str, subnet: str) -> str:
    return boto(moto, "ec2").describe_subnets(SubnetIds=[subnet])["Subnets"][0]["AvailabilityZone"]


def test_job_group_lives_in_one_az_and_has_az_rebalance_suspended(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(job(instance_types=["g5.xlarge"]), write_script(tmp_path / "src")))
    g = asg(moto, f"{stack_name}-job-demo")
    subnets = g["VPCZoneIdentifier"].split(",")
    assert len(subnets) == 1
    hosts = ready.hosts("demo")
    assert {h.az for h in hosts} == {subnet_az(moto, subnets[0])}  # every instance in the one AZ
    assert [p["ProcessName"] for p in g["SuspendedProcesses"]] == list(capacity.SUSPENDED_PROCESSES)
    assert any(line.startswith("job demo placed in ") for line in ready.lines)


def test_multi_az_job_spans_every_subnet_and_is_warned(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(job(instance_types=["g5.xlarge"], multi_az=True), write_script(tmp_path / "src")))
    g = asg(moto, f"{stack_name}-job-demo")
    every = ready.settings["outputs"]["SubnetIds"].split(",")
    assert sorted(g["VPCZoneIdentifier"].split(",")) == sorted(every)
    assert any(line.startswith("WARNING: --multi-az") and "$0.01/GB" in line for line in ready.lines)
    assert ready.fallback_az("demo", in_service=0) is None  # a multi-AZ group never moves


def test_fallback_moves_the_group_to_the_next_az_on_insufficient_capacity(ready, moto, tmp_path, stack_name,
                                                                           monkeypatch):
    ready.create_job(submit(job(instance_types=["g5.xlarge"]), write_script(tmp_path / "src")))
    name = f"{stack_name}-job-demo"
    first = asg(moto, name)["VPCZoneIdentifier"]
    monkeypatch.setattr(capacity, "activities", lambda autoscaling, group, limit=20: [NO_CAPACITY])
    new_az = ready.fallback_az("demo", in_service=0)
    moved = asg(moto, name)["VPCZoneIdentifier"]
    assert new_az and moved != first and subnet_az(moto, moved) == new_az != subnet_az(moto, first)
    bucket = ready.settings["outputs"]["BucketName"]
    body = boto(moto, "s3").get_object(Bucket=bucket, Key="jobs/demo/placement.json")["Body"].read()
    record = json.loads(body)
    assert record["current"] == 1 and record["azs"][1] == new_az and len(record["moves"]) == 1
    # the next poll still sees that failure as the newest activity: it is about the AZ left, no move
    stale = [Activity("Failed", NO_CAPACITY.message, az=record["azs"][0], start=record["moved_at"] - 5)]
    monkeypatch.setattr(capacity, "activities", lambda autoscaling, group, limit=20: stale)
    assert ready.fallback_az("demo", in_service=0) is None
    assert asg(moto, name)["VPCZoneIdentifier"] == moved
    # once capacity came through, nothing moves
    recovered = [Activity("Successful", "")]
    monkeypatch.setattr(capacity, "activities", lambda autoscaling, group, limit=20: recovered)
    assert ready.fallback_az("demo", in_service=0) is None
    assert asg(moto, name)["VPCZoneIdentifier"] == moved


def test_run_job_refuses_mixed_gpus_before_any_aws_change(ready, moto, tmp_path, stack_name):
    from petctl.core.errors import ValidationError

    with pytest.raises(ValidationError, match="same GPU count and model"):
        ready.create_job(submit(job(instance_types=["g5.xlarge", "g6.xlarge"]),
                                write_script(tmp_path / "src")))
    stacks = all_stacks(moto)
    assert not [s for s in stacks if s["StackName"] == f"{stack_name}-job-demo"]


def test_fallback_check_failures_are_reported_once_each_way_and_never_end_the_wait(ready, monkeypatch):
    outcomes = [ProviderError("Throttling"), ProviderError("Throttling"), None, None]

    def fallback_az(name, in_service=None):
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(ready, "fallback_az", fallback_az)
    poll = ready.fallback_poller("demo")
    for _ in range(4):
        poll(0)
    reports = [line for line in ready.lines if "fallback check" in line]
    assert len(reports) == 2 and "failed (Throttling)" in reports[0] and "after 2 failure(s)" in reports[1]
