"""Issue 11 against moto: the job's group starts empty and run_job fills it (item 2), a finished job's
stack is deleted by the CLI through the base stack's service role (item 3), the vCPU quota is checked
before anything is created and scaling activities explain a group that does not fill (item 7).

moto's server runs in this process, so a test can make the emulated EC2 short of capacity (no launch)
or give the account a quota of 0, with pytest's monkeypatch on moto's own backend, for that test only.
"""

from __future__ import annotations

import json
import time

import pytest

from petctl.core.errors import ProviderError
from petctl.core.records import JobResult
from petctl.core.spec import JobSpec
from petctl.providers.aws import inventory
from petctl.providers.base import JobInfo
from tests.aws.rendered import parse
from tests.support.aws.account import all_stacks, boto, submit, write_script


def spec(name: str = "demo", min_size: int = 1, max_size: int = 4, size: int = 2, **kw) -> JobSpec:
    return JobSpec(name=name, min_size=min_size, max_size=max_size, size=size, entrypoint="", **kw)


def group(moto: str, name: str) -> dict:
    groups = boto(moto, "autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[name])
    return groups["AutoScalingGroups"][0] if groups["AutoScalingGroups"] else {}


def live_stack(moto: str, name: str) -> dict | None:
    stacks = all_stacks(moto)
    found = [s for s in stacks if s["StackName"] == name and s["StackStatus"] != "DELETE_COMPLETE"]
    return found[0] if found else None


@pytest.fixture
def no_capacity(monkeypatch):
    """EC2 has no capacity: the group's desired count is set, but no instance ever launches, and its
    scaling activities say why (as AWS's would)."""
    from moto.autoscaling.models import FakeAutoScalingGroup
    from moto.autoscaling.responses import AutoScalingResponse
    from moto.core.responses import ActionResult

    monkeypatch.setattr(FakeAutoScalingGroup, "replace_autoscaling_group_instances",
                        lambda self, count_needed, propagated_tags: None)
    activity = {"ActivityId": "a-1", "AutoScalingGroupName": "", "StatusCode": "Failed",
                "Description": "Launching a new EC2 instance.  Status Reason: ...",
                "Cause": "capacity", "StartTime": "2026-01-01T00:00:00Z", "Progress": 100,
                "StatusMessage": "We currently do not have sufficient g5.xlarge capacity in the Availability "
                                 "Zone you requested (InsufficientInstanceCapacity)."}
    monkeypatch.setattr(AutoScalingResponse, "describe_scaling_activities",
                        lambda self: ActionResult({"Activities": [activity]}))


def test_group_is_created_empty_and_run_job_raises_it_to_min_and_size(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(min_size=1, size=3), write_script(tmp_path / "src")))
    name = f"{stack_name}-job-demo"
    template = parse(boto(moto, "cloudformation").get_template(StackName=name)["TemplateBody"])
    created = template["Resources"]["Group"]["Properties"]  # what CloudFormation waited for: nothing
    assert created["MinSize"] == "0" and "DesiredCapacity" not in created
    g = group(moto, name)
    assert (g["MinSize"], g["MaxSize"], g["DesiredCapacity"]) == (1, 4, 3)
    assert sum(i["LifecycleState"] == "InService" for i in g["Instances"]) == 3


def test_a_group_that_never_fills_neither_hangs_nor_fails_the_stack(ready, moto, tmp_path, stack_name,
                                                                    no_capacity):
    ready.wait_timeout = 0.5
    began = time.monotonic()
    info = ready.create_job(submit(spec(size=2), write_script(tmp_path / "src")))
    assert time.monotonic() - began < 20  # not CloudFormation's hour
    name = f"{stack_name}-job-demo"
    assert live_stack(moto, name)["StackStatus"] == "CREATE_COMPLETE"  # no rollback
    g = group(moto, name)
    assert (g["MinSize"], g["DesiredCapacity"], len(g["Instances"])) == (1, 2, 0)  # still trying
    assert (info.state, info.desired) == ("running", 2)
    assert any("only 0/2 instances launched" in line for line in ready.lines)
    explained = [line for line in ready.lines if "scaling activity Failed" in line]
    assert explained and "InsufficientInstanceCapacity" in explained[0] and "keeps trying" in explained[0]
    # status/hosts show the same explanation
    assert "InsufficientInstanceCapacity" in ready.scaling_activities("demo")[0]


def test_job_stacks_are_created_with_the_base_stacks_service_role(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    role = ready.settings["outputs"]["JobStackRoleArn"]
    assert role.startswith("arn:aws:iam::") and ":role/" in role
    roles = boto(moto, "iam").list_roles()["Roles"]
    assert role in {r["Arn"] for r in roles}  # the base stack created it
    stack = live_stack(moto, f"{stack_name}-job-demo")
    if "RoleARN" in stack:  # moto records it when its version echoes it back
        assert stack["RoleARN"] == role


def test_a_finished_jobs_stack_is_deleted_by_the_next_cli_command(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    name = f"{stack_name}-job-demo"
    # what the agent that recorded the end does: result.json, then its group to 0 (agent.py)
    bucket = ready.settings["outputs"]["BucketName"]
    result = {"job": "demo", "state": "succeeded", "reason": "all workers exited 0", "ts": time.time()}
    boto(moto, "s3").put_object(Bucket=bucket, Key="jobs/demo/result.json", Body=json.dumps(result).encode())
    boto(moto, "autoscaling").update_auto_scaling_group(AutoScalingGroupName=name, MinSize=0,
                                                        DesiredCapacity=0)
    assert {j.name: j.state for j in ready.jobs()} == {"demo": "succeeded"}  # result.json decides
    assert any(f"deleting its stack {name}" in line for line in ready.lines)
    assert live_stack(moto, name) is None and group(moto, name) == {}
    assert ready.job("demo").state == "succeeded"  # on record after its stack
    ready.teardown()  # nothing left to refuse it


def test_an_older_base_stack_without_the_role_still_lists_jobs(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    bucket = ready.settings["outputs"]["BucketName"]
    result = {"job": "demo", "state": "succeeded", "reason": "done", "ts": time.time()}
    boto(moto, "s3").put_object(Bucket=bucket, Key="jobs/demo/result.json", Body=json.dumps(result).encode())
    del ready.settings["outputs"]["JobStackRoleArn"]  # as recorded by a setup before issue 11
    assert {j.name: j.state for j in ready.jobs()} == {"demo": "succeeded"}
    assert any("run `petctl setup --provider aws` again" in line for line in ready.lines)
    assert live_stack(moto, f"{stack_name}-job-demo") is not None  # left for a later command
    with pytest.raises(Exception, match="predates job stacks' service role"):
        ready.create_job(submit(spec(name="next"), write_script(tmp_path / "src")))


def test_teardown_does_not_refuse_for_jobs_that_ended(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    bucket = ready.settings["outputs"]["BucketName"]
    result = {"job": "demo", "state": "failed", "reason": "max restarts", "ts": time.time()}
    boto(moto, "s3").put_object(Bucket=bucket, Key="jobs/demo/result.json", Body=json.dumps(result).encode())
    ready.teardown()  # no --force needed: the job is over, its stack just goes
    assert live_stack(moto, f"{stack_name}-job-demo") is None and live_stack(moto, stack_name) is None


@pytest.mark.parametrize("status", ["DELETE_FAILED", "ROLLBACK_COMPLETE", "CREATE_COMPLETE"])
def test_result_json_decides_the_state_whatever_the_stack_says(status):
    stack = {"StackName": "p-job-a", "StackStatus": status, "Tags": [{"Key": "petctl:job", "Value": "a"}],
             "StackStatusReason": "The following resource(s) failed to delete: [WorkerRole]."}

    class NoGroup:
        def describe_auto_scaling_groups(self, **kw):
            return {"AutoScalingGroups": []}

    info = inventory.job_info(NoGroup(), stack, "aws")
    out = inventory.apply_result(info, JobResult(state="succeeded", reason="all workers exited 0", ts=5.0))
    assert isinstance(out, JobInfo) and (out.state, out.reason) == ("succeeded", "all workers exited 0")
    assert inventory.apply_result(inventory.job_info(NoGroup(), stack, "aws"), None).state == (
        "running" if status == "CREATE_COMPLETE" else "failed")


# --- the vCPU quota, before anything is created -----------------------------------------------------
def test_quota_unknown_on_the_emulator_is_a_warning(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(instance_types=["g5.xlarge"]), write_script(tmp_path / "src")))
    warning = [line for line in ready.lines if line.startswith("warning: spot vCPU quota L-3819A6DF")]
    assert warning and "not checked" in warning[0]
    assert live_stack(moto, f"{stack_name}-job-demo")["StackStatus"] == "CREATE_COMPLETE"


@pytest.fixture
def zero_gpu_spot_quota(monkeypatch):
    from moto.servicequotas.models import ServiceQuotasBackend

    original = ServiceQuotasBackend.get_service_quota

    def get_service_quota(self, service_code, quota_code):
        if (service_code, quota_code) == ("ec2", "L-3819A6DF"):
            return {"ServiceCode": "ec2", "QuotaCode": quota_code, "Value": 0.0,
                    "QuotaName": "All G and VT Spot Instance Requests"}
        return original(self, service_code, quota_code)

    monkeypatch.setattr(ServiceQuotasBackend, "get_service_quota", get_service_quota)


def test_a_quota_below_one_instance_refuses_the_job_and_creates_nothing(ready, moto, tmp_path, stack_name,
                                                                        zero_gpu_spot_quota):
    with pytest.raises(ProviderError, match=r"L-3819A6DF .* is 0 vCPUs, below the 4 of one g5.xlarge"):
        ready.create_job(submit(spec(instance_types=["g5.xlarge"]), write_script(tmp_path / "src")))
    assert live_stack(moto, f"{stack_name}-job-demo") is None
    bucket = ready.settings["outputs"]["BucketName"]
    assert boto(moto, "s3").list_objects_v2(Bucket=bucket, Prefix="jobs/demo/").get("KeyCount") == 0
    # CPU types draw on another quota (unknown here): not refused
    ready.create_job(submit(spec(name="cpu", instance_types=["c5.xlarge"]), write_script(tmp_path / "src")))


# --- through the CLI: the same explanations, one-line errors -----------------------------------------
def cli(*args: str):
    from click.testing import CliRunner

    from petctl.cli.group import cli as group

    return CliRunner().invoke(group, list(args), catch_exceptions=True)


def test_status_and_hosts_show_why_the_group_does_not_fill(ready, moto, tmp_path, no_capacity):
    ready.wait_timeout = 0.3
    ready.create_job(submit(spec(size=2), write_script(tmp_path / "src")))
    for command in (["status", "demo"], ["hosts", "demo"]):
        result = cli(*command)
        assert result.exit_code == 0, result.output
        assert "scaling activities (newest first):" in result.output
        assert "InsufficientInstanceCapacity" in result.output and "keeps trying" in result.output
    data = json.loads(cli("status", "demo", "-o", "json").output)
    assert "InsufficientInstanceCapacity" in data["scaling_activities"][0]


def test_a_quota_refusal_is_one_line_and_non_zero_through_the_cli(ready, moto, tmp_path, stack_name,
                                                                  zero_gpu_spot_quota, capsys):
    from petctl.cli.group import main

    script = write_script(tmp_path / "src")
    with pytest.raises(SystemExit) as exited:
        main(["run_job", "--name", "gpu", "--min", "1", "--max", "2", "--instance-type", "g5.xlarge",
              str(script)])
    assert exited.value.code == 4
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "L-3819A6DF" in errors[0] and "Traceback" not in err
    assert live_stack(moto, f"{stack_name}-job-gpu") is None


# --- the etcd host's size, against the job's ------------------------------------------------------
def test_a_job_of_hundreds_of_nodes_on_a_burstable_etcd_host_is_warned_once_and_still_runs(
        ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(name="big", max_size=400), write_script(tmp_path / "src")))
    warned = [line for line in ready.lines if "burstable etcd host" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: a job of up to 400 nodes"), ready.lines
    assert "etcd_instance_type=c7i.large" in warned[0] and "(t3.small)" in warned[0]
    assert live_stack(moto, f"{stack_name}-job-big")["StackStatus"] == "CREATE_COMPLETE"
    ready.create_job(submit(spec(name="small", max_size=300), write_script(tmp_path / "src2")))
    assert len([line for line in ready.lines if "burstable etcd host" in line]) == 1, "300 nodes: no warning"


def test_the_etcd_warning_follows_the_setup_option_not_only_the_default():
    from petctl.providers.aws.basestack import etcd_host_warning

    assert etcd_host_warning({}, 301) is not None  # the default t3.small
    assert etcd_host_warning({"options": {"etcd_instance_type": "t4g.medium"}}, 1000) is not None
    assert etcd_host_warning({"options": {"etcd_instance_type": "c7i.large"}}, 1000) is None
    assert etcd_host_warning({"options": {"etcd_instance_type": "t3.small"}}, 300) is None
