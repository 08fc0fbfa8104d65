"""The rendered boot scripts, run for real by bash with fake `docker`, `aws`, `curl` (IMDS and the AWS
APIs, the job's bucket), `systemctl`, `sleep` and `shutdown` on PATH: retries with backoff; a worker's
boot that fails for good records why and abandons its launch lifecycle hook (tests/aws/test_boot_breaker.py
has the breaker); the etcd host's has the Auto Scaling group replace it (SetInstanceHealth Unhealthy), and
either shuts down when neither works.

The SigV4 signing the scripts do in bash (the ECS GPU AMI has no AWS CLI) is checked against botocore's
signer for the same request."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from petctl.core.records import BootRecord
from petctl.io.etcdpki import EtcdPki
from petctl.providers.aws.boot import etcd_user_data
from petctl.providers.aws.etcdsecrets import host_bundle
from tests.aws.test_boot_scripts import IMAGE, worker

INSTANCE = "i-0123456789abcdef0"
ETCD_BINARY = b"\x7fELF fake etcd\n"
CREDS = {"AccessKeyId": "ASIAFAKEFAKEFAKE", "SecretAccessKey": "fake/secret+key", "Token": "tok/en+=="}
PASSWORD = "ecr-password-123"

FAKE_CURL = r"""#!/bin/bash
# IMDSv2 and the AWS APIs, as far as the boot scripts use them. Every call is logged as one JSON line.
url="" headers=() data="" out="" method=GET status=""
while [ $# -gt 0 ]; do
  case "$1" in
    -H) headers+=("$2"); shift 2 ;;
    --data-binary|--data) data="$2"; shift 2 ;;
    -o) out="$2"; shift 2 ;;
    -w) status=1; shift 2 ;;
    -X) method="$2"; shift 2 ;;
    --max-time|--cacert|--cert|--key) shift 2 ;;
    http*) url="$1"; shift ;;
    *) shift ;;
  esac
done
python3 - "$url" "$data" "${headers[@]}" >> "$FAKE_LOG" <<'PY'
import json, sys
print(json.dumps({"cmd": "curl", "url": sys.argv[1], "data": sys.argv[2], "headers": sys.argv[3:]}))
PY
fail() {  # fail NAME: true while the NAME counter (FAKE_FAIL_NAME failures wanted) is not used up
  local want counter="$FAKE_DIR/count.$1" n
  want=$(printenv "FAKE_FAIL_$1" || echo 0)
  n=$(cat "$counter" 2>/dev/null || echo 0)
  echo $((n + 1)) > "$counter"
  [ "$n" -lt "$want" ]
}
case "$url" in
  */latest/api/token) echo -n tok ;;
  */meta-data/instance-id) echo -n "$FAKE_INSTANCE" ;;
  */meta-data/local-ipv4) echo -n 10.42.0.99 ;;
  */meta-data/placement/region) echo -n us-west-2 ;;
  */meta-data/iam/security-credentials/) echo -n petctl-role ;;
  */meta-data/iam/security-credentials/petctl-role) cat "$FAKE_DIR/creds.json" ;;
  https://api.ecr.*) fail ECR && exit 22; cat "$FAKE_DIR/ecr.json" ;;
  https://autoscaling.*)
    fail AUTOSCALING && exit 22
    case "$data" in *Action=CompleteLifecycleAction*) fail LAUNCH && exit 22 ;; esac
    echo "<Response/>" ;;
  https://*.s3.*.amazonaws.com/*)
    fail S3 && exit 22
    python3 "$FAKE_DIR/s3.py" "$method" "$url" "$data" || exit 22 ;;
  https://127.0.0.1:2379/health) fail HEALTH && exit 7; echo '{"health":"true","reason":""}' ;;
  https://127.0.0.1:2379/v2/auth/*)  # etcd's v2 auth API, as root: auth already on
    case "$method ${url#*/v2/auth/}" in
      "GET enable") echo '{"enabled":true}' > "$out"; echo -n 200 ;;
      PUT*) echo '{}' > "$out"; echo -n 201 ;;
      *) echo '{}' > "$out"; echo -n 200 ;;
    esac ;;
  *) exit 6 ;;
esac
"""

FAKE_S3 = r"""
# The job's bucket, as far as the boot records use it: PUT, GET and ListObjectsV2 on files under s3/.
import pathlib, sys, urllib.parse
method, url, data = sys.argv[1:4]
parts = urllib.parse.urlsplit(url)
root = pathlib.Path(__file__).parent / "s3"
key = parts.path.lstrip("/")
query = urllib.parse.parse_qs(parts.query)
if method == "PUT":
    (root / key).parent.mkdir(parents=True, exist_ok=True)
    (root / key).write_text(data)
elif "list-type" in query:
    prefix = query["prefix"][0]
    keys = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    print("<ListBucketResult>" + "".join(f"<Contents><Key>{k}</Key></Contents>" for k in keys
                                          if k.startswith(prefix)) + "</ListBucketResult>")
elif (root / key).is_file():
    print((root / key).read_text(), end="")
else:
    sys.exit(1)
"""

FAKE_DOCKER = r"""#!/bin/bash
echo "{\"cmd\": \"docker\", \"args\": \"$*\"}" >> "$FAKE_LOG"
counter="$FAKE_DIR/count.docker-$1"
n=$(cat "$counter" 2>/dev/null || echo 0); echo $((n + 1)) > "$counter"
case "$1" in
  info) [ "$n" -ge "${FAKE_FAIL_DOCKER_INFO:-0}" ] ;;
  login) cat > "$FAKE_DIR/docker-password" ;;
  pull) [ "$n" -ge "${FAKE_FAIL_DOCKER_PULL:-0}" ] ;;
  *) true ;;
esac
"""

FAKE_AWS = r"""#!/bin/bash
echo "{\"cmd\": \"aws\", \"args\": \"$*\"}" >> "$FAKE_LOG"
case "$1 $2" in
  "ec2 describe-network-interfaces")
    case "$*" in
      *Attachment.InstanceId*) echo "$FAKE_INSTANCE" ;;
      *) echo eni-0123 ;;
    esac ;;
  "s3 cp")
    counter="$FAKE_DIR/count.s3"
    n=$(cat "$counter" 2>/dev/null || echo 0); echo $((n + 1)) > "$counter"
    [ "$n" -ge "${FAKE_FAIL_S3:-0}" ] || exit 1
    cp "$FAKE_DIR/etcd" "${@: -1}" ;;
  "secretsmanager get-secret-value")
    counter="$FAKE_DIR/count.secret"
    n=$(cat "$counter" 2>/dev/null || echo 0); echo $((n + 1)) > "$counter"
    [ "$n" -ge "${FAKE_FAIL_SECRET:-0}" ] || exit 255
    cat "$FAKE_DIR/host-secret" ;;
  "s3api list-objects-v2") echo None ;;
  *) exit 2 ;;
esac
"""


def _logger(name: str) -> str:
    return f'#!/bin/bash\necho "{{\\"cmd\\": \\"{name}\\", \\"args\\": \\"$*\\"}}" >> "$FAKE_LOG"\n'


FAKES = {
    "curl": FAKE_CURL, "docker": FAKE_DOCKER, "aws": FAKE_AWS,
    "etcdctl": '#!/bin/bash\necho "{\\"cmd\\": \\"etcdctl\\", \\"args\\": \\"$*\\"}" >> "$FAKE_LOG"\n'
               'echo "Authentication Status: true"\n',
    "sleep": _logger("sleep"), "shutdown": _logger("shutdown"), "systemctl": _logger("systemctl"),
    "useradd": _logger("useradd"), "logger": "#!/bin/bash\ncat > /dev/null\n",
    "ip": "#!/bin/bash\necho '    inet 10.42.0.10/20 scope global ens6'\n",
    # `install -o USER` needs root and that user: the fake keeps everything else
    "install": "#!/bin/bash\nargs=()\nwhile [ $# -gt 0 ]; do case \"$1\" in -o|-g) shift 2 ;; "
               "*) args+=(\"$1\"); shift ;; esac; done\nexec /usr/bin/install \"${args[@]}\"\n",
}


class Boot:
    """A directory playing one instance: fakes on PATH, files under root/, every call in calls.jsonl."""

    def __init__(self, tmp_path: Path) -> None:
        if not shutil.which("bash") or not shutil.which("openssl") or not shutil.which("python3"):
            pytest.skip("bash, openssl and python3 are needed to run the boot scripts")
        self.dir = tmp_path
        self.root = tmp_path / "root"
        (self.root / "var" / "log").mkdir(parents=True)
        fakes = tmp_path / "fakes"
        fakes.mkdir()
        for name, text in FAKES.items():
            (fakes / name).write_text(text)
            (fakes / name).chmod(0o755)
        (tmp_path / "creds.json").write_text(json.dumps({"Code": "Success", **CREDS}))
        token = base64.b64encode(f"AWS:{PASSWORD}".encode()).decode()
        (tmp_path / "ecr.json").write_text(json.dumps({"authorizationData": [
            {"authorizationToken": token, "proxyEndpoint": "https://" + IMAGE.split("/")[0]}]}))
        (tmp_path / "etcd").write_bytes(ETCD_BINARY)
        (tmp_path / "s3.py").write_text(FAKE_S3)
        self.s3 = tmp_path / "s3"  # the job's bucket
        (tmp_path / "host-secret").write_text(host_bundle(EtcdPki.new("petctl"), ("10.42.0.10",)))
        self.log = tmp_path / "calls.jsonl"
        self.env = {"PATH": f"{fakes}:{os.environ['PATH']}", "PETCTL_ROOT": str(self.root),
                    "FAKE_LOG": str(self.log), "FAKE_DIR": str(tmp_path), "FAKE_INSTANCE": INSTANCE,
                    "HOME": str(tmp_path), "PETCTL_BUCKET": "petctl-bucket",
                    "ETCDCTL": str(fakes / "etcdctl")}

    def run(self, script: str, timeout: float = 60, **fail: int) -> subprocess.CompletedProcess:
        path = self.dir / "user-data.sh"
        path.write_text(script)
        env = {**self.env, **{f"FAKE_FAIL_{k.upper()}": str(v) for k, v in fail.items()}}
        return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=timeout)

    def calls(self, cmd: str | None = None) -> list[dict]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [c for c in map(json.loads, lines) if cmd is None or c["cmd"] == cmd]

    def sleeps(self) -> list[int]:
        return [int(c["args"]) for c in self.calls("sleep")]

    def docker(self, sub: str) -> int:
        return sum(1 for c in self.calls("docker") if c["args"].split()[0] == sub)

    def autoscaling(self, action: str) -> list[dict[str, list[str]]]:
        """The Auto Scaling API calls of one action the script made (tries included)."""
        return [q for c in self.calls("curl") if c["url"].startswith("https://autoscaling.")
                and (q := parse_qs(c["data"]))["Action"] == [action]]

    def unhealthy_calls(self) -> list[dict[str, list[str]]]:
        return self.autoscaling("SetInstanceHealth")

    def boot_records(self) -> list[str]:
        """The boot records' keys in the job's prefix (the fake bucket), in the order they happened: by
        their time (whole seconds), then by stage (two marks often share a second, and their names then
        sort `installing` before `started`; petctl/core/boots.py `stages` orders them the same way)."""
        from petctl.core.boots import BOOT_EVENTS

        names = [p.name for p in (self.s3 / "jobs/demo/boots").glob("*.json")]
        return sorted(names, key=lambda n: (n.split(".")[0], BOOT_EVENTS.index(n.split(".")[2])))


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
def etcd_script(sha256: str | None = None) -> str:
    import hashlib

    digest = sha256 or hashlib.sha256(ETCD_BINARY).hexdigest()
    ctl = hashlib.sha256(ETCD_BINARY).hexdigest()  # the fake bucket serves the same bytes for etcdctl
    return etcd_user_data("petctl", "10.42.0.10", "dist/etcd/v3.5.1-x/etcd", digest, "v3.5.1",
                          etcdctl_sha256=ctl)


def test_etcd_boot_fetches_the_verified_binary_from_the_bucket_and_starts_a_health_check(boot):
    result = boot.run(etcd_script(), s3=3, secret=2)
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
    assert [c["url"] for c in boot.calls("curl") if "/v2/auth/" in c["url"]][:2] == [
        "https://127.0.0.1:2379/v2/auth/roles/guest", "https://127.0.0.1:2379/v2/auth/enable"]
    unit = (boot.root / "etc/systemd/system/etcd.service").read_text()
    assert "--enable-v2" in unit
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

