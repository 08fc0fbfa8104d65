"""`petctl doctor --provider aws` against moto: one line per check, SKIP (with why) where the emulator
lacks the API (Service Quotas for EC2, IAM policy simulation), FAIL with the reason otherwise, and a
non-zero exit when anything fails. The real-account verdicts are the user's to run (docs/aws.md)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from petctl.providers.aws.doctor import principal_arn
from tests.support.aws.account import REGION, boto, publish_dlami, push_worker_image, worker_image


def run(*args: str):
    from petctl.cli.group import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=True)


def lines_by_check(output: str) -> dict[str, str]:
    checks = {}
    for line in output.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("OK", "FAIL", "SKIP"):
            checks[rest.strip().split(":")[0]] = status
    return checks


@pytest.fixture
def doctor(ready):
    def check():
        return {c.name: c for c in ready.doctor()}
    return check


def test_doctor_on_a_ready_installation(ready, doctor, stack_name):
    checks = doctor()
    assert checks["credentials"].status == "OK" and REGION in checks["credentials"].reason
    assert checks["base stack"].status == "OK" and "UPDATE_COMPLETE" in checks["base stack"].reason  # seed
    assert checks["worker image"].status == "OK" and "none" in checks["worker image"].reason  # the AMI's
    quota = checks["spot vCPU quota L-3819A6DF (All G and VT Spot Instance Requests)"]
    assert quota.status == "SKIP" and "does not report" in quota.reason  # moto: vpc quotas only
    assert checks["operator permissions"].status == "SKIP"  # moto lacks SimulatePrincipalPolicy
    assert "does not implement" in checks["operator permissions"].reason
    # which torch and CUDA a job started now gets: the Deep Learning AMI's, from its public parameter
    ami = checks["worker AMI"]
    assert ami.status == "OK" and "jobs get torch 2.13 with CUDA 13.0 (/opt/pytorch/bin/python)" in ami.reason
    assert "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023)" in ami.reason


def test_doctor_fails_on_a_dlami_outside_the_supported_torch_range(ready, doctor, moto):
    publish_dlami(moto, name="Deep Learning OSS Nvidia Driver AMI GPU PyTorch 3.1 (Amazon Linux 2023) 2027")
    try:
        check = doctor()["worker AMI"]
        assert check.status == "FAIL" and "outside petctl's supported range >=2.5,<3" in check.reason
    finally:
        publish_dlami(moto)


def test_doctor_fails_on_a_missing_image_and_says_why(ready, doctor, moto):
    ready.settings["image"] = worker_image(ready)  # an installation-wide --image (setup's image option)
    check = doctor()["worker image"]
    assert check.status == "FAIL" and "not in ECR" in check.reason
    ready.settings["image"] = worker_image(ready) + "-arm"
    push_worker_image(moto, ready.settings["image"], architecture="arm64")
    check = doctor()["worker image"]
    assert check.status == "FAIL" and "built for linux/arm64" in check.reason
    ready.settings["image"] = worker_image(ready)
    push_worker_image(moto, worker_image(ready))
    checks = doctor()
    assert checks["worker image"].status == "OK" and checks["worker image"].reason.endswith("linux/amd64")
    ami = checks["worker AMI"]
    assert ami.status == "OK" and "torch and CUDA: the image's" in ami.reason


def test_doctor_reports_a_zero_quota_as_fail(ready, doctor, monkeypatch):
    from moto.servicequotas.models import ServiceQuotasBackend

    monkeypatch.setattr(ServiceQuotasBackend, "get_service_quota",
                        lambda self, service_code, quota_code: {"QuotaCode": quota_code, "Value": 0.0})
    checks = doctor()
    gpu = checks["spot vCPU quota L-3819A6DF (All G and VT Spot Instance Requests)"]
    assert gpu.status == "FAIL" and "below one g4dn.xlarge (4)" in gpu.reason


def test_doctor_cli_prints_one_line_per_check_and_exits_non_zero_on_a_failure(ready, moto, monkeypatch):
    ready.settings["image"] = worker_image(ready) + "-not-pushed"
    ready.config.save()
    result = run("doctor", "--provider", "aws")
    assert result.exit_code == 1
    checks = lines_by_check(result.output)
    assert checks["worker image"] == "FAIL" and checks["credentials"] == "OK"
    assert checks["operator permissions"] == "SKIP"
    assert "Traceback" not in result.output


def test_doctor_without_setup_fails_on_the_base_stack(provider, moto, monkeypatch):
    provider.settings.update(region=REGION, endpoint_url=moto, stack_name="nosuchstack")
    checks = {c.name: c for c in provider.doctor()}
    assert checks["credentials"].status == "OK"
    assert checks["base stack"].status == "FAIL" and "petctl setup" in checks["base stack"].reason


@pytest.mark.parametrize("caller, principal", [
    ("arn:aws:sts::123456789012:assumed-role/Admin/alice", "arn:aws:iam::123456789012:role/Admin"),
    ("arn:aws:iam::123456789012:user/bob", "arn:aws:iam::123456789012:user/bob"),
    ("arn:aws:iam::123456789012:root", ""),
])
def test_the_simulated_principal_is_the_callers_role_or_user(caller, principal):
    assert principal_arn(caller) == principal


def test_moto_really_lacks_policy_simulation(moto):
    """If this starts failing, moto gained the API: make the permissions check assert OK here."""
    with pytest.raises(Exception):  # noqa: B017 (any failure of the call is what we rely on)
        boto(moto, "iam").simulate_principal_policy(PolicySourceArn="arn:aws:iam::123456789012:user/x",
                                                    ActionNames=["ec2:RunInstances"])


def test_doctor_for_a_provider_without_checks_says_so_and_passes(aws_env):
    result = run("doctor", "--provider", "local")
    assert result.exit_code == 0 and result.output.startswith("SKIP provider: no checks for the local")
