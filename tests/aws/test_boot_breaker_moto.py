"""End to end on the emulator: a job whose boots all fail stops itself.

`run_job` against moto launches three instances; each runs its own user data's boot steps up to a step
that fails for good (tests/aws/instance_emulator.fail_boot), its signed S3 and Auto Scaling requests
answered by moto. The third failure trips the boot breaker: the group's sizes go to 0 and the job ends
`failed` with the reason and the newest boot log lines, as `petctl status -o json` and `run_job --wait`
report them. moto does not model lifecycle actions (CompleteLifecycleAction fails there), so each boot
falls back to marking itself Unhealthy; the abandon itself is checked against AWS's contract in
tests/aws/test_boot_failures.py and test_templates.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from petctl.core.errors import PetctlError
from petctl.core.spec import JobSpec
from tests.aws.instance_emulator import InstanceEmulator
from tests.support.aws.account import REGION, boto, submit, write_script

ERROR = "pip install -r requirements.txt failed: No matching distribution found for torhc==9.9"
LOG = ["attempt 3/3 failed: pip install -r requirements.txt", "ERROR: No matching distribution found for "
       "torhc==9.9", "giving up after 3 attempts: pip install -r requirements.txt"]


@pytest.fixture
def emulator(moto, aws_env, tmp_path):
    emu = InstanceEmulator(moto_url=moto, region=REGION, root=tmp_path / "instances", env=dict(aws_env))
    yield emu
    emu.stop()


def test_three_boots_that_never_join_stop_the_job(ready, moto, emulator, stack_name, tmp_path, capsys):
    from petctl.cli.bootview import wait_joined
    from petctl.cli.group import cli

    spec = JobSpec(name="noboot", min_size=3, max_size=3, size=3, entrypoint="",
                   instance_types=["c5.xlarge"])
    ready.create_job(submit(spec, write_script(tmp_path / "src")))
    group_name = f"{stack_name}-job-noboot"
    autoscaling = boto(moto, "autoscaling")
    (group,) = autoscaling.describe_auto_scaling_groups(
        AutoScalingGroupNames=[group_name])["AutoScalingGroups"]
    instances = sorted(i["InstanceId"] for i in group["Instances"])
    assert len(instances) == 3

    for n, instance in enumerate(instances):
        result = emulator.fail_boot(instance, ERROR, LOG)
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"FATAL: {ERROR}" in result.stderr
        (group,) = autoscaling.describe_auto_scaling_groups(
            AutoScalingGroupNames=[group_name])["AutoScalingGroups"]
        sizes = (group["MinSize"], group["MaxSize"], group["DesiredCapacity"])
        assert (sizes == (0, 0, 0)) is (n == 2), (n, sizes, result.stderr)
        # moto has no lifecycle actions: the abandon fails there and the boot marks itself Unhealthy
        assert "launch abandoned" not in result.stderr
    reason = f"3 boots in a row never joined: {ERROR}"

    # `run_job --wait` would have shown each failure, then ended non-zero with the reason
    with pytest.raises(PetctlError, match="failed before any agent joined: 3 boots in a row never joined"):
        wait_joined(ready, "noboot", timeout=30, interval=0.05)
    progress = capsys.readouterr().out
    assert progress.count("boot failed") == 3 and ERROR in progress

    # `petctl status -o json`, through the CLI
    run = CliRunner().invoke(cli, ["status", "noboot", "-o", "json"], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    data = json.loads(run.output[run.output.index("{"):])
    assert (data["state"], data["reason"]) == ("failed", reason)
    boots = data["boots"]
    assert boots["breaker"] == {"never_joined": 3, "tripped": True, "limit": 3,
                                "last_instance": instances[-1], "last_hung": False}
    assert boots["last_failure"]["error"] == ERROR and boots["last_failure"]["log_tail"][-3:] == LOG
    assert set(boots["stages"]) == set(instances) and set(boots["stages"].values()) == {"failed"}
    assert boots["joined"] == []
    # ... and as text: the reason and the newest boot log lines
    text = CliRunner().invoke(cli, ["status", "noboot"], catch_exceptions=False).output
    assert reason in text and f"  | {LOG[-1]}" in text
