"""`petctl doctor --provider aws --probe` end to end on the emulator: the command as a user runs it, on an
installation `setup` made against moto, both probe jobs run and are cleaned up, and the printed table
says which contracts held and which only AWS can show.

The emulator plays EC2 for the probe's two groups (`ProbeEc2`). The first job's instance boots for real:
its boot script on a fake Deep Learning AMI pip-installs the launching petctl's wheel and the probe's one
requirement, and its agent trains the packaged probe script 50 steps (tests/aws/instance_emulator.py).
The second job's requirement cannot install; each of its instances runs its own boot script up to that
failure (`InstanceEmulator.fail_boot`: the fake AMI has no index to fail against, and its `curl` answers
only the metadata service, so a boot there could not record its failure), its signed S3 and Auto Scaling
requests answered by moto. Then, as AWS does with an abandoned launch, the instance ends and the group
launches the next. The third failure trips the boot breaker. moto has no lifecycle hooks, no IAM policy
simulation and assumes no role: those rows must read "needs AWS"."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from petctl.cli.context import CliContext
from petctl.providers.aws import probe
from tests.aws.instance_emulator import InstanceEmulator
from tests.support.aws.account import REGION, all_stacks, boto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ERROR = "cannot install petctl and the job's requirements into /opt/pytorch/bin"
LOG = ["ERROR: Could not find a version that satisfies the requirement packaging<0",
       "giving up after 3 attempts: install_petctl"]


class ProbeEc2:
    """EC2 for the probe's groups (those of `prefix`), in the background: the first job's instances boot,
    each of the second's (`-nojoin`) fails its boot and is then terminated."""

    def __init__(self, emulator: InstanceEmulator, moto: str, prefix: str) -> None:
        self.emulator, self.moto, self.prefix = emulator, moto, prefix
        self.good: set[str] = set()
        self.failed: dict[str, int] = {}  # instance -> its boot script's exit status
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="probe-ec2", daemon=True)

    def __enter__(self) -> ProbeEc2:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        autoscaling = boto(self.moto, "autoscaling")
        while not self._stop.wait(0.3):
            try:
                pages = autoscaling.get_paginator("describe_auto_scaling_groups").paginate()
                names = {g["AutoScalingGroupName"] for page in pages for g in page["AutoScalingGroups"]
                         if g["AutoScalingGroupName"].startswith(self.prefix)}
                for name in sorted(names | self.good):
                    if name.endswith("-nojoin"):
                        self._fail(name)
                    else:
                        self.good.add(name)  # followed after its group is gone: its agents must stop
                        self.emulator.sync(name)
            except Exception as exc:  # noqa: BLE001 keep emulating; the test reports what went wrong
                self.errors.append(repr(exc))

    def _fail(self, group: str) -> None:
        for instance in self.emulator.group_instances(group):
            if instance in self.failed:
                continue
            result = self.emulator.fail_boot(instance, ERROR, LOG)
            self.failed[instance] = result.returncode
            # AWS ends an abandoned launch (moto, without lifecycle actions, only marked it Unhealthy)
            boto(self.moto, "ec2").terminate_instances(InstanceIds=[instance])


@pytest.fixture
def emulator(moto, aws_env, tmp_path):
    pytest.importorskip("torch", reason="the probe job trains with torch")
    emu = InstanceEmulator(moto_url=moto, region=REGION, root=tmp_path / "instances", env=dict(aws_env))
    yield emu
    emu.stop()


def live_probe_stacks(moto: str, stack_name: str) -> list[str]:
    prefix = f"{stack_name}-job-probe-"
    return [f"{s['StackName']} ({s['StackStatus']})" for s in all_stacks(moto)
            if s["StackName"].startswith(prefix) and s["StackStatus"] != "DELETE_COMPLETE"]


def rows(output: str) -> dict[str, tuple[str, str]]:
    """contract -> (verdict, detail) from the printed table."""
    found = {}
    names = [name for name, _ in probe.CONTRACTS]
    for line in output.splitlines():
        for name in names:
            if line.startswith(name + " "):
                rest = line[len(name):].strip()
                for status in (probe.NEEDS_AWS, probe.NOT_REACHED, probe.HELD, probe.BROKEN):
                    if rest.startswith(status):
                        found[name] = (status, rest[len(status):].strip())
    return found


def test_the_probe_runs_both_jobs_prints_every_contract_and_leaves_nothing(ready, moto, emulator, stack_name,
                                                                           monkeypatch, capsys):
    from petctl.cli.group import main

    monkeypatch.setattr(probe, "STEP_SECONDS", 0.0)
    ready.poll_interval = 0.3  # moto answers one request at a time: leave room for the agents'
    ready.wait_timeout = 60.0
    outputs = ready.settings["outputs"]
    emulator.boot_etcd_host(outputs["EtcdGroupName"])
    with ProbeEc2(emulator, moto, f"{stack_name}-job-probe-") as ec2, pytest.raises(SystemExit) as ended:
        main(["doctor", "--provider", "aws", "--probe", "--instance-type", "c5.large"],
             obj=CliContext(provider=ready))
    out = capsys.readouterr().out
    table = rows(out)
    detail = (f"{out}\nprogress:\n" + "\n".join(ready.lines[-60:])
              + f"\nemulator: {emulator.errors} {ec2.errors}")
    assert ended.value.code == 0, detail + "\n" + emulator.console()

    # every contract has its row: what moto can show held, the rest needs AWS
    assert set(table) == {name for name, _ in probe.CONTRACTS}, detail
    assert {name for name, (status, _) in table.items() if status == probe.NEEDS_AWS} == set(
        probe.EMULATOR_BLIND), detail
    assert {name for name, (status, _) in table.items() if status == probe.HELD} == {
        "job role boundary", "probe job trains", "boot breaker", "nothing left behind"}, detail
    assert table["probe job trains"][1] == f"{probe.STEPS} steps; the job succeeded"
    assert table["boot breaker"][1].startswith(f"3 boots in a row never joined: {ERROR}")
    # what the emulator did show, in the needs-AWS rows: the boot, the worker's HOME and limit, deletion
    assert "petctl installed and its agent joined; tqdm " in table["pip and the CLI on the DLAMI"][1]
    assert "/var/lib/petctl/.cache" in table["HOME and the file limit"][1]
    assert "2 stack(s) DELETE_COMPLETE" in table["deletion under the service role"][1]
    assert "does not implement IAM policy simulation" in table["spot notice detach"][1]
    assert out.splitlines()[-1].startswith("elapsed ") and "instance-hours" in out.splitlines()[-1]
    assert sorted(ec2.failed.values()) == [1, 1, 1] and len(ec2.good) == 1, ec2.failed

    # nothing of the probe is left: stacks, groups, S3 keys (its jobs' prefixes, their etcd users)
    assert live_probe_stacks(moto, stack_name) == []
    groups = boto(moto, "autoscaling").get_paginator("describe_auto_scaling_groups").paginate()
    assert [g["AutoScalingGroupName"] for page in groups for g in page["AutoScalingGroups"]
            if g["AutoScalingGroupName"].startswith(f"{stack_name}-job-probe-")] == []
    s3 = boto(moto, "s3")
    for prefix in ("jobs/probe-", "etcd-users/probe-"):
        left = s3.list_objects_v2(Bucket=outputs["BucketName"], Prefix=prefix).get("Contents", [])
        assert left == [], (prefix, [o["Key"] for o in left])  # which writer outlived the clean-up
    assert emulator.errors == [] and ec2.errors == [], (emulator.errors, ec2.errors)


def test_sigterm_while_the_probe_waits_cleans_up_and_still_prints_the_table(ready, moto, stack_name,
                                                                           monkeypatch, capsys):
    """No instance boots here (no emulator): both jobs' stacks are created, then a SIGTERM arrives while
    the probe waits for the first. Both are deleted, their prefixes emptied, the table printed with what
    was not reached, and the command ends as an interrupted one (130)."""
    from petctl.cli.group import main

    def terminated(provider, job, echo):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler interrupts this
        raise AssertionError("SIGTERM did not interrupt the probe")

    monkeypatch.setattr(probe, "_watch_good", terminated)
    ready.wait_timeout = 5.0
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        main(["doctor", "--provider", "aws", "--probe"], obj=CliContext(provider=ready))
    captured = capsys.readouterr()
    assert ended.value.code == 130 and captured.err.strip() == "error: interrupted"  # after click's newline
    table = rows(captured.out)
    assert table["probe job trains"] == (probe.NOT_REACHED, "stopped by SIGTERM")
    assert table["boot breaker"] == (probe.NOT_REACHED, "stopped by SIGTERM")  # both jobs had started
    assert table["trust-policy key"][0] == probe.NEEDS_AWS  # its stack was created
    assert table["job role boundary"][0] == probe.HELD
    assert table["nothing left behind"] == (probe.HELD, "clean")
    assert "stopped by SIGTERM" in ready.lines and "probe: cleaning up" in ready.lines
    assert signal.getsignal(signal.SIGTERM) is before  # the probe's handlers are gone again
    assert table["deletion under the service role"] == (
        probe.NEEDS_AWS, "the emulator deletes with no role (seen here: 2 stack(s) DELETE_COMPLETE)")
    assert live_probe_stacks(moto, stack_name) == []
    bucket = ready.settings["outputs"]["BucketName"]
    assert boto(moto, "s3").list_objects_v2(Bucket=bucket, Prefix="jobs/probe-").get("KeyCount", 0) == 0


def test_a_failure_while_the_probe_waits_still_cleans_up_and_exits_non_zero(ready, moto, stack_name,
                                                                            monkeypatch, capsys):
    from petctl.cli.group import main

    def fails(provider, job, echo):
        raise RuntimeError("the network went away")

    monkeypatch.setattr(probe, "_watch_good", fails)
    ready.wait_timeout = 5.0
    with pytest.raises(SystemExit) as ended:
        main(["doctor", "--provider", "aws", "--probe"], obj=CliContext(provider=ready))
    captured = capsys.readouterr()
    assert ended.value.code == 1 and captured.err.startswith("error: ") and captured.err.count("\n") == 1
    table = rows(captured.out)
    assert table["probe job trains"] == (probe.NOT_REACHED, "stopped: RuntimeError: the network went away")
    assert table["nothing left behind"] == (probe.HELD, "clean")
    assert live_probe_stacks(moto, stack_name) == []
    bucket = ready.settings["outputs"]["BucketName"]
    s3 = boto(moto, "s3")
    for prefix in ("jobs/probe-", "etcd-users/probe-"):
        assert s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount", 0) == 0, prefix
