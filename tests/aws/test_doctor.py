"""`petctl doctor --provider aws` against moto: one line per check, SKIP (with why) where the emulator
lacks the API (Service Quotas for EC2, IAM policy simulation), FAIL with the reason otherwise, and a
non-zero exit when anything fails. The real-account verdicts are the user's to run (docs/aws.md)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from petctl.providers.aws.doctor import principal_arn
from tests.aws.conftest import REGION, boto


def run(*args: str):
    from petctl.cli.main import cli

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
    assert checks["base stack"].status == "OK" and "CREATE_COMPLETE" in checks["base stack"].reason
    assert checks["worker image"].status == "OK"  # conftest's `ready` pushed it
    quota = checks["spot vCPU quota L-3819A6DF (All G and VT Spot Instance Requests)"]
    assert quota.status == "SKIP" and "does not report" in quota.reason  # moto: vpc quotas only
    assert checks["operator permissions"].status == "SKIP"  # moto lacks SimulatePrincipalPolicy
    assert "does not implement" in checks["operator permissions"].reason
    assert checks["worker AMI"].status in ("OK", "FAIL")  # moto knows some AMIs, not every SSM value


def test_doctor_fails_on_a_missing_image_and_says_why(ready, doctor, moto):
    ready.settings["image"] = ready.settings["image"].rsplit(":", 1)[0] + ":not-pushed"
    check = doctor()["worker image"]
    assert check.status == "FAIL" and "not in ECR" in check.reason


def test_doctor_reports_a_zero_quota_as_fail(ready, doctor, monkeypatch):
    from moto.servicequotas.models import ServiceQuotasBackend

    monkeypatch.setattr(ServiceQuotasBackend, "get_service_quota",
                        lambda self, service_code, quota_code: {"QuotaCode": quota_code, "Value": 0.0})
    checks = doctor()
    gpu = checks["spot vCPU quota L-3819A6DF (All G and VT Spot Instance Requests)"]
    assert gpu.status == "FAIL" and "below one g4dn.xlarge (4)" in gpu.reason


def test_doctor_cli_prints_one_line_per_check_and_exits_non_zero_on_a_failure(ready, moto, monkeypatch):
    ready.settings["image"] = ready.settings["image"].rsplit(":", 1)[0] + ":not-pushed"
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
