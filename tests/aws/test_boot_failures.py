"""The rendered boot scripts, run for real by bash with fake `docker`, `aws`, `curl` (IMDS and the AWS
APIs, the job's bucket), `systemctl`, `sleep` and `shutdown` on PATH: retries with backoff; a worker's
boot that fails for good records why and abandons its launch lifecycle hook (tests/aws/test_boot_breaker.py
has the breaker); the etcd host's has the Auto Scaling group replace it (SetInstanceHealth Unhealthy), and
either shuts down when neither works.

The SigV4 signing the scripts do in bash (the ECS GPU AMI has no AWS CLI) is checked against botocore's
signer for the same request."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime, timezone

import pytest

from petctl.core.records import BootRecord
from petctl.providers.aws.boot import etcd_user_data
from tests.support.aws.boot import IMAGE, worker
from tests.support.aws.boot_harness import CREDS, ETCD_BINARY, INSTANCE, PASSWORD, Boot


@pytest.fixture
def boot(tmp_path) -> Boot:
    return Boot(tmp_path)


# --- worker ---------------------------------------------------------------------------------------------
def test_worker_boot_retries_each_step_with_backoff_then_starts_the_agent(boot):
    result = boot.run(worker(), docker_info=2, ecr=1, docker_pull=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert boot.docker("info") == 3 and boot.docker("pull") == 3  # it waited for the daemon, then pulled
    assert boot.sleeps() == [2, 4, 2, 5, 10]  # docker info x2, ECR x1, pull x2: doubling delays
    assert (boot.dir / "docker-password").read_text() == PASSWORD  # the token, without a host AWS CLI
    unit = (boot.root / "etc/systemd/system/petctl-agent.service").read_text()
    assert f"--node-id {INSTANCE} --host-addr 10.42.0.99" in unit and IMAGE in unit
    assert "Restart=on-failure" in unit and "OnFailure=petctl-unhealthy.service" in unit
    assert "--log-opt mode=non-blocking" in unit  # awslogs never blocks the agent's output
    assert {"cmd": "systemctl", "args": "enable --now petctl-agent.service"} in boot.calls()
    assert json.loads((boot.root / "etc/petctl/agent.json").read_text())["job"]["name"] == "demo"
    assert boot.unhealthy_calls() == [] and boot.calls("shutdown") == []
    # its boot recorded (started, then installing: `run_job --wait`'s progress); the agent records `joined`
    assert [name.split(".")[1:3] for name in boot.boot_records()] == [[INSTANCE, "started"],
                                                                      [INSTANCE, "installing"]]
    assert boot.autoscaling("CompleteLifecycleAction") == []  # the agent completes it, once joined


def test_worker_whose_pull_keeps_failing_records_why_and_abandons_its_launch(boot):
    result = boot.run(worker(), docker_pull=99)
    assert result.returncode == 1
    assert boot.docker("pull") == 6 and boot.sleeps() == [5, 10, 20, 40, 60]
    (call,) = boot.autoscaling("CompleteLifecycleAction")
    assert call == {"Action": ["CompleteLifecycleAction"], "Version": ["2011-01-01"],
                    "AutoScalingGroupName": ["petctl-job-demo"], "LifecycleHookName": ["petctl-boot"],
                    "InstanceId": [INSTANCE], "LifecycleActionResult": ["ABANDON"]}
    assert boot.unhealthy_calls() == [] and boot.calls("shutdown") == []  # terminated by the group
    assert boot.autoscaling("UpdateAutoScalingGroup") == []  # one failure trips no breaker
    failed = [n for n in boot.boot_records() if n.endswith(".failed.json")]
    (record,) = [BootRecord.from_json((boot.s3 / "jobs/demo/boots" / n).read_text()) for n in failed]
    assert (record.instance_id, record.event) == (INSTANCE, "failed")
    assert record.error == f"cannot pull {IMAGE}"
    assert any("giving up after 6 attempts: docker pull" in line for line in record.log_tail)
    assert not [c for c in boot.calls("systemctl") if "petctl-agent" in c["args"]]  # never started


def test_a_failed_boots_record_has_its_last_log_lines_even_when_the_log_lags(boot):
    """The boot log is written through `tee` in a process substitution, which runs behind the script:
    under load, the failure record read the log's tail before the reason reached it (a CI run lost
    "giving up after 6 attempts" that way). A tee 50 ms behind on every line makes that certain; the
    script ends the tee and waits for it (`log_sync`) before it reads the tail."""
    real_sleep = shutil.which("sleep", path="/usr/bin:/bin")
    lagging = boot.dir / "fakes" / "tee"
    lagging.write_text("#!/bin/bash\nwhile IFS= read -r line; do " + real_sleep + " 0.05; "
                       "printf '%s\\n' \"$line\" >> \"$2\"; printf '%s\\n' \"$line\"; done\n")
    lagging.chmod(0o755)
    result = boot.run(worker(), docker_pull=99)
    assert result.returncode == 1
    (name,) = [n for n in boot.boot_records() if n.endswith(".failed.json")]
    record = BootRecord.from_json((boot.s3 / "jobs/demo/boots" / name).read_text())
    assert record.log_tail[-2:] == [f"giving up after 6 attempts: docker pull {IMAGE}",
                                    f"FATAL: cannot pull {IMAGE}"]
    log = (boot.root / "var/log/petctl-boot.log").read_text()
    assert "launch abandoned" in log  # what came after the sync is appended to the log directly


def test_worker_that_can_neither_abandon_nor_mark_itself_unhealthy_shuts_down(boot):
    result = boot.run(worker(), docker_info=99, autoscaling=99)
    assert result.returncode == 1
    assert boot.docker("info") == 8 and boot.docker("pull") == 0
    assert len(boot.autoscaling("CompleteLifecycleAction")) == 3  # retried,
    assert len(boot.unhealthy_calls()) == 3  # then the group's health check, retried, then the fallback
    assert boot.calls("shutdown") == [{"cmd": "shutdown", "args": "-h now"}]


def test_agent_unit_failure_after_joining_marks_the_instance_unhealthy(boot):
    assert boot.run(worker()).returncode == 0
    helper = boot.root / "usr/local/bin/petctl-mark-unhealthy"  # what petctl-unhealthy.service runs
    unit = (boot.root / "etc/systemd/system/petctl-unhealthy.service").read_text()
    assert "ExecStart=/usr/local/bin/petctl-mark-unhealthy" in unit
    # InService: no launch action is pending any more (AWS answers CompleteLifecycleAction with an error)
    env = {**boot.env, "FAKE_FAIL_LAUNCH": "99"}
    result = subprocess.run([str(helper), "agent failed"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "FATAL: agent failed" in result.stderr
    assert len(boot.autoscaling("CompleteLifecycleAction")) == 3
    assert [c["InstanceId"] for c in boot.unhealthy_calls()] == [[INSTANCE]]


def test_bash_sigv4_matches_botocore(boot):
    """The ECR call the worker signs in bash carries the signature botocore computes for that request."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    boot.env["PETCTL_SIGV4_NOW"] = "20260102T030405Z"
    assert boot.run(worker()).returncode == 0
    (call,) = [c for c in boot.calls("curl") if c["url"].startswith("https://api.ecr.")]
    headers = dict(h.split(": ", 1) for h in call["headers"])
    request = AWSRequest(method="POST", url=call["url"], data=call["data"].encode(), headers={
        "Content-Type": headers["Content-Type"], "X-Amz-Target": headers["X-Amz-Target"]})
    signer = SigV4Auth(Credentials(CREDS["AccessKeyId"], CREDS["SecretAccessKey"], CREDS["Token"]), "ecr",
                       "us-west-2")
    import botocore.auth

    fixed = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    original = botocore.auth.get_current_datetime
    botocore.auth.get_current_datetime = lambda *a, **k: fixed
    try:
        signer.add_auth(request)
    finally:
        botocore.auth.get_current_datetime = original
    assert headers["X-Amz-Target"] == "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken"
    assert headers["Authorization"] == request.headers["Authorization"]
    assert headers["X-Amz-Security-Token"] == CREDS["Token"]


# --- etcd host ------------------------------------------------------------------------------------------
def etcd_script(sha256: str | None = None, store: str = "v3") -> str:
    import hashlib

    digest = sha256 or hashlib.sha256(ETCD_BINARY).hexdigest()
    ctl = hashlib.sha256(ETCD_BINARY).hexdigest()  # the fake bucket serves the same bytes for etcdctl
    return etcd_user_data("petctl", "10.42.0.10", "dist/etcd/v3.5.1-x/etcd", digest, "v3.5.1",
                          etcdctl_sha256=ctl, store=store)  # type: ignore[arg-type]


@pytest.mark.parametrize("store", ["v3", "v2"])
def test_etcd_boot_fetches_the_verified_binary_from_the_bucket_and_starts_a_health_check(boot, store):
    result = boot.run(etcd_script(store=store), s3=3, secret=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (boot.root / "usr/local/bin/etcd").read_bytes() == ETCD_BINARY
    s3 = [c["args"] for c in boot.calls("aws") if c["args"].startswith("s3 cp")]
    assert len(s3) == 5 and all("s3://petctl-bucket/dist/etcd/v3.5.1-x/etcd" in a for a in s3)
    assert s3[-1].split()[3].endswith("/etcdctl")  # etcdctl too: it turns v3 auth on
    assert not [c for c in boot.calls("curl") if "github" in c["url"]]  # nothing from the internet
    # its certificates from Secrets Manager (retried), split into files etcd reads
    assert sum(1 for c in boot.calls("aws") if c["args"].startswith("secretsmanager get-secret-value")) == 3
    assert sorted(p.name for p in (boot.root / "etc/petctl-etcd").glob("*.pem")) == [
        "admin-ca.pem", "jobs-ca.pem", "root-key.pem", "root.pem", "server-key.pem", "server.pem",
        "trusted.pem"]
    systemctl = [c["args"] for c in boot.calls("systemctl")]
    assert systemctl.index("enable --now etcd.service") < systemctl.index("restart etcd.service") < \
        systemctl.index("enable --now petctl-etcd-users.service")
    assert "enable --now petctl-etcd-health.service" in systemctl
    assert any(c["args"].endswith("auth status") for c in boot.calls("etcdctl"))
    v2_calls = [c["url"] for c in boot.calls("curl") if "/v2/" in c["url"]]
    unit = (boot.root / "etc/systemd/system/etcd.service").read_text()
    if store == "v2":  # etcd 3.5: v2's auth first (the guest role emptied before it is enabled)
        assert v2_calls[:2] == ["https://127.0.0.1:2379/v2/auth/roles/guest",
                                "https://127.0.0.1:2379/v2/auth/enable"]
        assert "--enable-v2" in unit
    else:  # etcd 3.6 has no v2 API: one v2 call would fail every boot
        assert v2_calls == [] and "--enable-v2" not in unit
    assert "--client-cert-auth --trusted-ca-file /etc/petctl-etcd/trusted.pem" in unit
    assert boot.unhealthy_calls() == []


def test_etcd_boot_without_its_certificates_is_replaced(boot):
    result = boot.run(etcd_script(), secret=99)
    assert result.returncode == 1
    log = (boot.root / "var/log/petctl-boot.log").read_text()
    assert "cannot read etcd's certificates from Secrets Manager (petctl/etcd/host)" in log
    assert not [c for c in boot.calls("systemctl") if "etcd.service" in c["args"]]  # never started
    assert [c["HealthStatus"] for c in boot.unhealthy_calls()] == [["Unhealthy"]]


def test_etcd_boot_with_a_corrupt_binary_is_replaced(boot):
    result = boot.run(etcd_script(sha256="0" * 64))
    assert result.returncode == 1
    assert len([c for c in boot.calls("aws") if c["args"].startswith("s3 cp")]) == 12
    assert not (boot.root / "usr/local/bin/etcd").exists()
    assert [c["HealthStatus"] for c in boot.unhealthy_calls()] == [["Unhealthy"]]


def test_etcd_health_check_marks_a_dead_etcd_host_unhealthy(boot):
    assert boot.run(etcd_script()).returncode == 0
    env = {**boot.env, "FAKE_FAIL_HEALTH": "99"}
    result = subprocess.run([str(boot.root / "usr/local/bin/petctl-etcd-health")], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "failed 6 health checks in a row" in result.stderr
    boot_checks = 2  # the boot's own: before auth is on and after the restart
    assert len([c for c in boot.calls("curl") if c["url"].endswith(":2379/health")]) == 6 + boot_checks
    assert [c["InstanceId"] for c in boot.unhealthy_calls()] == [[INSTANCE]]

