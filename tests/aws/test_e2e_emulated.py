"""End to end on the AWS code path: `setup` and `run_job` against moto, the instances moto launches booted
as real agents from their own user data (tests/aws/instance_emulator.py), a real etcd for the etcd host,
and a real DDP job that trains, checkpoints to the job's S3 prefix and finishes; then `status`, `hosts`,
`logs`, an instance loss, `kill_job` and `teardown` through the same provider."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from petctl.spec import JobSpec, Timeouts
from tests.aws.conftest import REGION, boto
from tests.aws.instance_emulator import InstanceEmulator

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
def emulator(moto, aws_env, tmp_path):
    pytest.importorskip("torch", reason="the end-to-end job trains with torch")
    pytest.importorskip("petctl.agent.main", reason="the agent is not there yet")
    emu = InstanceEmulator(moto_url=moto, region=REGION, root=tmp_path / "instances", env=dict(aws_env))
    yield emu
    emu.stop()


def test_run_job_on_emulated_instances_trains_and_checkpoints_to_s3(
    ready, moto, emulator, stack_name, tmp_path
):
    outputs = ready.settings["outputs"]
    emulator.boot_etcd_host(outputs["EtcdGroupName"])
    timeouts = Timeouts(
        heartbeat_interval=0.5, heartbeat_ttl=3.0, last_call=1.0, join_timeout=120.0, stop_grace=3.0
    )
    spec = JobSpec(
        name="e2e",
        min_size=2,
        max_size=2,
        size=2,
        entrypoint="",
        nproc_per_node=1,
        env={"STEPS": "6"},
        timeouts=timeouts,
        instance_types=["c5.xlarge"],
    )
    info = ready.create_job(spec, HERE / "workload_train.py")
    assert (info.state, info.desired) == ("running", 2)
    emulator.follow(f"{stack_name}-job-e2e")

    # the agents form a round of two from the user data's config, train 6 steps and finish
    job = wait_for(
        lambda: (j := ready.job("e2e")).state != "running" and j, 180, "the job to finish", emulator
    )
    assert job.state == "succeeded", emulator.console()

    hosts = ready.hosts("e2e")
    instance_ids = {h.host_id for h in hosts}
    state = ready.node_states("e2e")  # etcd is inside the "VPC": this is the agents' S3 mirror
    assert set(state.nodes) == instance_ids and {n["state"] for n in state.nodes.values()} == {"succeeded"}
    bucket = outputs["BucketName"]
    listing = boto(moto, "s3").list_objects_v2(Bucket=bucket, Prefix="jobs/e2e/checkpoints/")
    assert listing.get("KeyCount", 0) > 0, "no checkpoint reached the job's S3 prefix"
    lines = list(ready.logs("e2e"))
    steps = [line for line in lines if '"event":"train.step"' in line.replace(" ", "")]
    assert (
        any('"step": 5' in line for line in steps)
        and {line.split("]")[0][1:] for line in steps} == instance_ids
    )

    # an instance lost for good is seen by hosts; kill_job then removes the job's capacity and only it
    victim = ready.terminate_host("e2e", None)
    wait_for(
        lambda: emulator.booted[victim].proc.poll() is not None, 30, "the victim's agent to die", emulator
    )
    assert {h.host_id: h.state for h in ready.hosts("e2e")}[victim] == "terminated"
    ready.kill_job("e2e")
    assert [j.name for j in ready.jobs()] == []
    ready.teardown()
    assert emulator.errors == []


def test_a_lost_spot_instance_is_replaced_and_training_resumes_from_s3(ready, moto, emulator, stack_name):
    """EC2 takes an instance mid-training (as a spot reclaim without notice would): the group launches a
    replacement, its agent boots from the same user data, and the job resumes from its S3 checkpoint."""
    emulator.boot_etcd_host(ready.settings["outputs"]["EtcdGroupName"])
    timeouts = Timeouts(
        heartbeat_interval=0.5, heartbeat_ttl=3.0, last_call=1.0, join_timeout=120.0, stop_grace=3.0
    )
    spec = JobSpec(
        name="spot",
        min_size=2,
        max_size=2,
        size=2,
        entrypoint="",
        env={"STEPS": "16", "STEP_TIME": "0.4"},
        timeouts=timeouts,
        instance_types=["c5.xlarge"],
    )
    ready.create_job(spec, HERE / "workload_train.py")
    emulator.follow(f"{stack_name}-job-spot")
    first = wait_for(
        lambda: len(emulator.booted) == 2 and set(emulator.booted), 60, "two instances", emulator
    )
    wait_for(lambda: all(max(emulator.steps(i), default=-1) >= 5 for i in first), 120, "step 5", emulator)

    victim = ready.terminate_host("spot", sorted(first)[0])
    replacement = wait_for(lambda: set(emulator.booted) - first, 30, "a replacement instance", emulator)
    job = wait_for(
        lambda: (j := ready.job("spot")).state != "running" and j, 240, "the job to finish", emulator
    )
    assert job.state == "succeeded", emulator.console()

    nodes = ready.node_states("spot").nodes
    (new,) = replacement
    assert nodes[new]["state"] == "succeeded" and nodes[victim].get("state") != "succeeded"
    lines = list(ready.logs("spot", node=new))
    resumed = [line for line in lines if '"event": "train.resumed"' in line]
    assert resumed, "the replacement did not resume from a checkpoint"
    assert max(emulator.steps(new)) == 15 and min(emulator.steps(new)) >= 4  # no restart from scratch
    ready.kill_job("spot")
