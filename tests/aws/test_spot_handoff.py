"""A spot notice's AWS side (issue 43): the instance leaves its group so the replacement starts at once,
and ends itself once its node has left (petctl/agent/autoscaling.py `AwsPlace`).

The contract, from AWS's documentation, encoded here:
- DetachInstances with ShouldDecrementDesiredCapacity=false keeps the desired capacity, so the group
  launches a replacement at once, also at its MaxSize (the detached instance no longer counts). moto
  5.2 implements exactly that (`detach_instances` refills the group to its desired capacity), so it is
  checked against moto: the same desired capacity, a new instance in the group, the detached one still
  running outside it (AWS: "it continues running and incurring charges").
- The detached instance ends itself with no IAM permission: the agent asks the host (`END_REQUEST` in
  its work dir), the host's `petctl-end-instance.path` unit powers off, and the launch template's
  `InstanceInitiatedShutdownBehavior: terminate` turns the OS shutdown into a termination. moto runs no
  OS, so this is checked on the rendered boot script and template, and the agent's half on a directory.
- A denied or refused detach (AccessDenied; an instance the group is already terminating is not InService)
  is one event and False, never an exception; the instance then stays on the termination hook's path.
What only a real account can show: how soon the replacement is InService (the boot), and that the
shutdown of a detached spot instance is billed only up to it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from petctl.agent.autoscaling import END_REQUEST, AwsPlace, make_client
from petctl.core.spec import AgentConfig, JobSpec
from petctl.io.eventlog import EventLog
from petctl.providers.aws.launch import WORK_DIRS
from tests.aws.rendered import job_template, parse
from tests.support.aws.account import REGION, boto, publish_dlami
from tests.support.aws.boot import unit_section, worker

ASG = "petctl-job-demo"
NODE = "i-0123456789abcdef0"


def config(work_dir: str = "", asg: str = ASG, node: str = NODE) -> AgentConfig:
    spec = JobSpec(name="demo", min_size=1, max_size=3, size=2, entrypoint="train.py")
    return AgentConfig(job=spec, node_id=node, work_dir=work_dir, asg_name=asg, region=REGION,
                       lifecycle_hook="petctl-drain", launch_hook="petctl-boot")


def events(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


class Recorder:
    """An autoscaling client that records each call; `fail` raises a botocore ClientError with that code."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail

    def detach_instances(self, **kwargs):
        self.calls.append(("detach_instances", kwargs))
        if self.fail:
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": self.fail, "Message": "no"}}, "DetachInstances")
        return {"Activities": [{"ActivityId": "act-1", "StatusCode": "InProgress"}]}


def place(tmp_path: Path, client=None, **kw) -> tuple[AwsPlace, io.StringIO]:
    out = io.StringIO()
    return AwsPlace(config(str(tmp_path), **kw), EventLog("agent", stream=out), autoscaling=client), out


# --- the detach --------------------------------------------------------------------------------------
def test_the_detach_keeps_the_desired_capacity_so_the_group_replaces_the_instance(tmp_path):
    rec = Recorder()
    p, out = place(tmp_path, rec)
    assert p.detach_for_replacement() is True
    assert rec.calls == [("detach_instances", {"InstanceIds": [NODE], "AutoScalingGroupName": ASG,
                                               "ShouldDecrementDesiredCapacity": False})]
    (event,) = events(out)
    assert event["event"] == "capacity.detached" and event["activities"] == ["act-1"]
    assert (event["asg"], event["instance_id"]) == (ASG, NODE)
    assert p.detach_for_replacement() is True and len(rec.calls) == 1  # once: a second detach would fail


@pytest.mark.parametrize("code", ["AccessDenied", "ValidationError", "Throttling"])
def test_a_denied_or_refused_detach_is_an_event_and_false_never_an_exception(tmp_path, code):
    """AccessDenied: a role without the permission; ValidationError: the instance is not InService (the
    group is already terminating it, e.g. Capacity Rebalancing on the same notice). The instance stays
    in its group, so it does not end itself: the termination hook's path applies."""
    p, out = place(tmp_path, Recorder(fail=code))
    assert p.detach_for_replacement() is False
    assert p.failures == 1 and not p.detached
    (event,) = events(out)
    assert event["event"] == "capacity.detach_failed" and event["code"] == code and "no" in event["error"]
    assert p.end_instance() is False and not (tmp_path / END_REQUEST).exists()
    assert events(out)[-1]["event"] == "capacity.end_skipped"


def test_an_instance_outside_any_group_detaches_nothing(tmp_path):
    rec = Recorder()
    p, out = place(tmp_path, rec, asg="")
    assert p.detach_for_replacement() is False and rec.calls == []
    assert events(out)[0]["event"] == "capacity.detach_skipped"


def test_without_credentials_the_detach_fails_as_an_event(tmp_path, aws_env, monkeypatch):
    """The real client path (boto3, the `agent` profile) against an endpoint that refuses: no exception."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    p, out = place(tmp_path)
    assert p.detach_for_replacement() is False
    assert events(out)[0]["event"] == "capacity.detach_failed"


# --- the end -----------------------------------------------------------------------------------------
def test_the_detached_instance_asks_the_host_to_end_it(tmp_path):
    p, out = place(tmp_path, Recorder())
    assert p.detach_for_replacement()
    assert p.end_instance() is True
    request = json.loads((tmp_path / END_REQUEST).read_text())
    assert (request["instance_id"], request["asg"]) == (NODE, ASG)
    assert not list(tmp_path.glob("*.partial"))  # written whole, then renamed into place
    assert events(out)[-1]["event"] == "capacity.ending"
    assert p.end_instance() is True and len(events(out)) == 2  # asked once


def test_an_instance_still_in_its_group_is_the_groups_to_end(tmp_path):
    p, out = place(tmp_path, Recorder())
    assert p.end_instance() is False
    assert not (tmp_path / END_REQUEST).exists() and events(out)[0]["event"] == "capacity.end_skipped"


def test_a_request_that_cannot_be_written_is_an_event_and_false(tmp_path):
    p, out = place(tmp_path / "missing", Recorder())
    assert p.detach_for_replacement()
    assert p.end_instance() is False and p.failures == 1
    assert events(out)[-1]["event"] == "capacity.end_failed"


def test_the_agent_writes_where_the_host_watches():
    """The agent's work dir (WORK_DIRS: /work in the container, the AMI's own path) is the host's
    /var/lib/petctl/work, which the host's path unit watches; it powers off, and the path unit is
    enabled before the agent starts."""
    text = worker()
    watch = unit_section(text, "petctl-end-instance.path")["PathExists"]
    assert watch == [f"{WORK_DIRS[False]}/{END_REQUEST}"]
    assert f"-v {WORK_DIRS[False]}:{WORK_DIRS[True]}" in text  # the container's /work is that directory
    assert AwsPlace(config(WORK_DIRS[True]), EventLog("agent", stream=io.StringIO())).end_request == Path(
        WORK_DIRS[True], END_REQUEST)
    end = unit_section(text, "petctl-end-instance.service")
    assert end["Type"] == ["oneshot"] and end["ExecStart"] == ["/usr/bin/systemctl poweroff"]  # not halt
    assert text.index("enable --now petctl-end-instance.path") < text.index(
        "enable --now petctl-agent.service")


@pytest.mark.parametrize("variant", ["spot-single", "spot-mixed"])
def test_an_os_shutdown_terminates_a_spot_worker(tmp_path, variant):
    """The launch template's InstanceInitiatedShutdownBehavior is terminate (a one-time spot instance
    cannot be stopped anyway); mixed groups launch spot through the group, with the same template."""
    resources = parse(job_template(tmp_path, variant))["Resources"]
    data = next(r for r in resources.values() if r["Type"] == "AWS::EC2::LaunchTemplate")["Properties"][
        "LaunchTemplateData"]
    assert data["InstanceInitiatedShutdownBehavior"] == "terminate"
    if "InstanceMarketOptions" in data:
        assert data["InstanceMarketOptions"]["SpotOptions"]["SpotInstanceType"] == "one-time"


# --- against the emulator ----------------------------------------------------------------------------
def group_of(moto: str, name: str) -> dict:
    return boto(moto, "autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[name])[
        "AutoScalingGroups"][0]


@pytest.mark.parametrize("max_size", [2, 4], ids=["at-max", "below-max"])
def test_moto_launches_the_replacement_and_the_detached_instance_runs_on(moto, stack_name, tmp_path,
                                                                         max_size):
    ec2, asg = boto(moto, "ec2"), boto(moto, "autoscaling")
    name = f"{stack_name}-job-demo"
    ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={
        "ImageId": publish_dlami(moto), "InstanceType": "g5.xlarge",
        "InstanceInitiatedShutdownBehavior": "terminate"})
    asg.create_auto_scaling_group(AutoScalingGroupName=name, MinSize=1, MaxSize=max_size, DesiredCapacity=2,
                                  LaunchTemplate={"LaunchTemplateName": name},
                                  AvailabilityZones=[f"{REGION}a"])
    before = {i["InstanceId"] for i in group_of(moto, name)["Instances"]}
    leaver = sorted(before)[0]
    out = io.StringIO()
    p = AwsPlace(config(str(tmp_path), asg=name, node=leaver), EventLog("agent", stream=out),
                 autoscaling=make_client(REGION, endpoint_url=moto))
    assert p.detach_for_replacement() is True
    after = group_of(moto, name)
    assert after["DesiredCapacity"] == 2  # not lowered ...
    members = {i["InstanceId"] for i in after["Instances"]}
    assert len(members) == 2 and leaver not in members  # ... so the group replaced the leaver at once
    assert members - before  # a new instance
    state = ec2.describe_instances(InstanceIds=[leaver])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state == "running"  # detached, it runs (and bills) until it ends itself
    assert events(out)[0]["event"] == "capacity.detached"
