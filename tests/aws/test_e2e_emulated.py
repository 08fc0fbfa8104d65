"""End to end on the AWS code path: `setup` and `run_job` against moto, the instances moto launches booted
as real agents from their own user data (tests/aws/instance_emulator.py): by default (no image) the
worker's real boot script runs on a fake Deep Learning AMI and pip-installs the launching petctl's wheel
from the job's S3 prefix, whose agent then runs; a real etcd for the etcd host,
and a real DDP job that trains, checkpoints to the job's S3 prefix, finishes and releases its own
capacity; `status`, `hosts`, `logs`, `jobs` and `teardown` through the same provider; and an instance
taken mid-training, replaced by the group, resuming from the S3 checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from petctl.core.spec import JobSpec, Timeouts
from tests.aws.instance_emulator import InstanceEmulator
from tests.support.aws.account import REGION, all_stacks, boto, submit, view

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def wait_for(predicate, timeout: float, what: str, emulator: InstanceEmulator, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(
        f"timed out waiting for {what}\nemulator errors: {emulator.errors}\n{emulator.console()}"
    )


@pytest.fixture
def lifecycle_calls(monkeypatch):
    """CompleteLifecycleAction calls moto received (it has none of its own: moto_patches adds one)."""
    from tests.aws.moto_patches import record_lifecycle_actions

    return record_lifecycle_actions(monkeypatch)


@pytest.fixture
def emulator(moto, aws_env, tmp_path):
    emu = InstanceEmulator(moto_url=moto, region=REGION, root=tmp_path / "instances", env=dict(aws_env))
    yield emu
    emu.stop()


def timeouts() -> Timeouts:
    return Timeouts(heartbeat_interval=0.5, heartbeat_ttl=3.0, last_call=1.0, join_timeout=120.0,
                    stop_grace=3.0)


def finished(provider, name: str):
    job = provider.job(name)
    return job if job.state not in ("running", "pending") else None


def stack_gone(moto: str, name: str) -> bool:
    stacks = all_stacks(moto)
    return not [s for s in stacks if s["StackName"] == name and s["StackStatus"] != "DELETE_COMPLETE"]


def reaped(provider, moto: str, name: str) -> bool:
    provider.jobs()  # a CLI command that sees an ended job with a stack deletes that stack
    return stack_gone(moto, name)


def test_run_job_on_emulated_instances_trains_and_checkpoints_to_s3(ready, moto, emulator, stack_name,
                                                                    lifecycle_calls):
    outputs = ready.settings["outputs"]
    emulator.boot_etcd_host(outputs["EtcdGroupName"])
    spec = JobSpec(name="e2e", min_size=2, max_size=2, size=2, entrypoint="", env={"STEPS": "6"},
                   timeouts=timeouts(), instance_types=["c5.xlarge"])
    info = ready.create_job(submit(spec, HERE / "workload_train.py"))
    assert (info.state, info.desired) == ("running", 2)
    instance_ids = {h.host_id for h in ready.hosts("e2e")}
    assert len(instance_ids) == 2
    emulator.follow(f"{stack_name}-job-e2e")

    # the agents form a round of two from the user data's config, train 6 steps and finish
    job = wait_for(lambda: finished(ready, "e2e"), 180, "the job to finish", emulator)
    assert job.state == "succeeded", emulator.console()

    # ... the agent that recorded the end scales its group to 0, and the CLI's next look at the job
    # (jobs/status) deletes the ended job's stack with the base stack's service role: the group goes, the
    # instances end
    wait_for(lambda: reaped(ready, moto, f"{stack_name}-job-e2e"), 60, "the job stack to be released",
             emulator)
    assert {h.host_id: h.state for h in ready.hosts("e2e")} == dict.fromkeys(instance_ids, "terminated")
    assert {j.name: j.state for j in ready.jobs()} == {"e2e": "succeeded"}  # on record after its stack

    def all_reported():  # etcd is inside the "VPC": this is the agents' S3 mirror, which each agent
        state = view(ready, "e2e").state()  # uploads on its own schedule and once more at exit
        states = {node: n.state for node, n in state.nodes.items()}
        # The releasing agent scales its own group to 0, so its instance's shutdown (SIGTERM) may reach it
        # before its last status upload: it may end "leaving". The job's result is recorded before that.
        return states if set(states) == instance_ids and "succeeded" in states.values() else None

    wait_for(all_reported, 60, "every node's final status in S3", emulator)
    # each agent, once registered, recorded its boot as joined (its launch hook's CONTINUE: below;
    # tests/agent/test_lifecycle_action.py checks that call against the service model)
    assert set(ready.boots("e2e").joined) == instance_ids
    listing = boto(moto, "s3").list_objects_v2(Bucket=outputs["BucketName"], Prefix="jobs/e2e/checkpoints/")
    assert listing.get("KeyCount", 0) > 0, "no checkpoint reached the job's S3 prefix"
    steps = [line for line in view(ready, "e2e").logs() if '"event": "train.step"' in line]
    assert any('"step": 5' in line for line in steps), steps
    assert {line.split("]")[0][1:] for line in steps} == instance_ids, steps

    # The default boot, no image: each instance's boot script installed the petctl that launched the job
    # (the wheel in the job's prefix, content-addressed) into the AMI's Python, and systemd runs it.
    (wheel,) = [o["Key"] for o in boto(moto, "s3").list_objects_v2(
        Bucket=outputs["BucketName"], Prefix="jobs/e2e/wheelhouse/")["Contents"]]
    version = wheel.rsplit("/", 1)[1].split("-")[1]
    assert version.startswith("0.1.0+")
    for instance_id in instance_ids:
        ami = emulator.amis[instance_id]
        installed, where = ami.installed_petctl()
        assert installed == version and where.startswith(str(ami.root / "opt" / "pytorch")), where
        assert [c["args"] for c in ami.calls("aws")] == [
            "--version",  # the AMI's checks: AWS CLI v2 on root's PATH (issue 44.6)
            f"s3 cp --only-show-errors s3://{outputs['BucketName']}/{wheel} "
            f"{ami.root}/var/lib/petctl/wheelhouse/{wheel.rsplit('/', 1)[1]}"]
        unit = ami.unit()
        assert (unit["User"], unit["KillMode"], unit["OnFailure"]) == ("petctl", "mixed",
                                                                       "petctl-unhealthy.service")
        assert {"cmd": "systemctl", "args": "enable --now petctl-agent.service"} in ami.calls()
        # the worker's home is its own (caches), and its file limit is not systemd's 1024 (issue 44.3, 44.4)
        assert (ami.root / "var/lib/petctl/.cache").is_dir() and unit["LimitNOFILE"] == "1048576"
        assert "HOME=/var/lib/petctl" in unit["Environment"].split()
        assert "docker" not in " ".join(c["cmd"] for c in ami.calls())
    # ... and each agent, once registered, completed its instance's launch hook with CONTINUE: the call
    # AWS needs before the instance leaves Pending:Wait (moto_patches.record_lifecycle_actions checks it as
    # AWS's API does: the group, its hook, the instance in it)
    launches = [c for c in lifecycle_calls if c["LifecycleHookName"] == "petctl-boot"]
    assert {c["InstanceId"] for c in launches} == instance_ids, lifecycle_calls
    assert {(c["AutoScalingGroupName"], c["LifecycleActionResult"]) for c in launches} == {
        (f"{stack_name}-job-e2e", "CONTINUE")}

    emulator.stop_following()  # every sync so far got its answers (moto takes one request at a time)
    assert emulator.errors == []
    ready.teardown()  # no job stack is left to refuse it
    assert stack_gone(moto, stack_name) and stack_gone(moto, f"{stack_name}-job-e2e")


def test_a_lost_spot_instance_is_replaced_and_training_resumes_from_s3(ready, moto, emulator, stack_name):
    """EC2 takes an instance mid-training (a spot reclaim): the group launches a replacement, its agent
    boots from the same user data, and the job resumes from its S3 checkpoint and finishes."""
    emulator.boot_etcd_host(ready.settings["outputs"]["EtcdGroupName"])
    spec = JobSpec(name="spot", min_size=2, max_size=2, size=2, entrypoint="",
                   env={"STEPS": "30", "STEP_TIME": "0.3"}, timeouts=timeouts(), instance_types=["c5.xlarge"])
    ready.create_job(submit(spec, HERE / "workload_train.py"))
    emulator.follow(f"{stack_name}-job-spot")
    # each boot is a real `pip install` of the job's wheel on its fake AMI (seconds; more on a loaded host)
    first = wait_for(lambda: len(emulator.booted) == 2 and set(emulator.booted), 120, "two agents", emulator)
    wait_for(lambda: all(max(emulator.steps(i), default=-1) >= 5 for i in first), 120, "step 5", emulator)

    victim = ready.terminate_host("spot", sorted(first)[0])
    assert {h.host_id: h.state for h in ready.hosts("spot")}[victim] == "terminated"
    replacement = wait_for(lambda: emulator.booting - first, 30, "a replacement instance", emulator)
    job = wait_for(lambda: finished(ready, "spot"), 240, "the job to finish", emulator)
    assert job.state == "succeeded", emulator.console()

    (new,) = replacement
    # The replacement's own mirror reached S3 (its last state depends on whether the capacity release
    # shut its instance down before its last upload; the console below shows what it trained).
    nodes = wait_for(lambda: (n := view(ready, "spot").state().nodes).get(new) and n, 60,
                     "the replacement's status in S3", emulator)
    # the victim may have gone before its first status upload (each agent's mirror has its own schedule)
    assert victim not in nodes or nodes[victim].state != "succeeded", nodes
    resumed = [line for line in view(ready, "spot").logs(node=new) if '"event": "train.resumed"' in line]
    assert resumed, f"the replacement did not resume from a checkpoint\n{emulator.console()}"
    new_steps = emulator.steps(new)
    assert max(new_steps) == 29 and min(new_steps) >= 4, new_steps  # resumed, not restarted from scratch
    wait_for(lambda: reaped(ready, moto, f"{stack_name}-job-spot"), 60, "the capacity to be released",
             emulator)
    emulator.stop_following()
    assert emulator.errors == []
