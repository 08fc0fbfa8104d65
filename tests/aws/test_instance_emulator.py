"""The instance emulator keeps AWS's order between a machine's end and its stack's deletion.

moto ends an instance at once; the emulator's machine (a process here) then shuts down, and its agent's
last flush to S3 comes after that. In AWS a stack is DELETE_COMPLETE only once its group's instances are
terminated, and kill_job and `doctor --probe` delete a job's S3 prefix only then. The probe's emulated test
(test_probe_emulated.py) once found 3 keys (an agent's status, events and log chunks) in a prefix it had
emptied: the machine's shutdown flush had landed after the stack's deletion was answered. Here a machine
whose instance moto ended writes 0.5 s after its SIGTERM: its key must be in S3 when DeleteStack answers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

from tests.aws.instance_emulator import Booted, InstanceEmulator
from tests.support.aws.account import REGION, boto

# A stand-in for an agent: it says when its SIGTERM handler is in place; on SIGTERM it takes a moment, as
# a final flush does, writes its last object and exits.
AGENT = textwrap.dedent("""
    import os, signal, sys, time
    import boto3

    def leave(*_):
        time.sleep(0.5)
        boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name=os.environ["REGION"]) \\
            .put_object(Bucket=sys.argv[1], Key=sys.argv[2], Body=b"the last flush")
        sys.exit(0)

    signal.signal(signal.SIGTERM, leave)
    print("ready", flush=True)
    while True:
        time.sleep(1)
""")
TEMPLATE = '{"Resources": {"Topic": {"Type": "AWS::SNS::Topic"}}}'


def machine(moto: str, tmp_path, instance_id: str, bucket: str) -> Booted:
    env = {**os.environ, "AWS_ENDPOINT_URL": moto, "REGION": REGION}
    log = tmp_path / f"{instance_id}.log"
    proc = subprocess.Popen([sys.executable, "-c", AGENT, bucket, f"jobs/j/status/{instance_id}.json"],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), env=env, start_new_session=True)
    assert proc.stdout.readline().strip() == b"ready", log.read_text()
    return Booted(instance_id, proc, log, stop_grace=10.0)


def test_delete_stack_answers_after_the_machines_moto_ended_made_their_last_write(moto, tmp_path):
    ec2, s3, cfn = boto(moto, "ec2"), boto(moto, "s3"), boto(moto, "cloudformation")
    bucket, stack = f"b-{uuid.uuid4().hex[:12]}", f"s{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    image = ec2.register_image(Name=f"img-{stack}", Architecture="x86_64",
                               RootDeviceName="/dev/xvda")["ImageId"]
    ended, running = (i["InstanceId"] for i in ec2.run_instances(ImageId=image, MinCount=2, MaxCount=2,
                                                                   InstanceType="c5.large")["Instances"])
    cfn.create_stack(StackName=stack, TemplateBody=TEMPLATE)
    emulator = InstanceEmulator(moto_url=moto, region=REGION, root=tmp_path / "instances")
    try:
        for instance_id in (ended, running):
            emulator.booted[instance_id] = machine(moto, tmp_path, instance_id, bucket)
        ec2.terminate_instances(InstanceIds=[ended])  # moto: `terminated` at once; the machine still runs

        cfn.delete_stack(StackName=stack)

        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert keys == [f"jobs/j/status/{ended}.json"]  # its last write is in; the running one wrote none
        assert emulator.booted[ended].proc.poll() == 0  # it shut down by itself, on SIGTERM
        assert emulator.booted[running].proc.poll() is None  # a machine moto still runs is left alone
        assert emulator.errors == []
    finally:
        emulator.stop()
    assert emulator.booted[running].proc.poll() is not None


def test_a_stopped_emulator_holds_up_no_deletion(moto, tmp_path):
    """`stop` takes the emulator off the server's list: a later DeleteStack does not ask it."""
    emulator = InstanceEmulator(moto_url=moto, region=REGION, root=tmp_path / "instances")
    emulator.stop()
    asked = []
    emulator.running = lambda ids: asked.append(ids) or set()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    emulator.booted["i-0"] = Booted("i-0", sleeper, tmp_path / "log")
    try:
        cfn = boto(moto, "cloudformation")
        stack = f"s{uuid.uuid4().hex[:10]}"
        cfn.create_stack(StackName=stack, TemplateBody=TEMPLATE)
        cfn.delete_stack(StackName=stack)
        assert asked == []
    finally:
        emulator.kill("i-0")
