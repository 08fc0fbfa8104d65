"""The worker's boot script as the AWS tests render it (one agent config, one image), and the checks on a
boot script's text: shell syntax, no secret, one systemd unit's settings."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from petctl.core.spec import AgentConfig, JobSpec
from petctl.providers.aws.boot import worker_boot_script

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/petctl-worker:0.1.0"
SECRET_MARKERS = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "aws_secret_access_key", "AKIA", "BEGIN RSA",
                  "BEGIN OPENSSH", "PRIVATE KEY", "password=", "AWS_SESSION_TOKEN")


def agent_config(**job) -> AgentConfig:
    spec = JobSpec(name="demo", min_size=1, max_size=3, size=2, entrypoint="train.py",
                   args=["--msg", "it's $HOME `x`"], code_url="s3://b/jobs/demo/code/train.py",
                   checkpoint_url="s3://b/jobs/demo/checkpoints", etcd_endpoint="http://10.42.0.10:2379",
                   **job)
    return AgentConfig(job=spec, node_id="", host_addr="", work_dir="/work",
                       imds_endpoint="http://169.254.169.254", asg_name="petctl-job-demo",
                       lifecycle_hook="petctl-drain", launch_hook="petctl-boot", region="us-west-2",
                       status_url="s3://b/jobs/demo/")


def worker(gpus: bool = True, **job) -> str:
    """The --image worker's boot script (what its user data fetches from the job's prefix)."""
    return worker_boot_script(agent_config(**job), image=IMAGE, log_group="/petctl/petctl",
                              config_url="s3://b/jobs/demo/agent.json", gpus=gpus).text


def bash_syntax_ok(text: str, tmp_path: Path) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    path = tmp_path / "boot.sh"
    path.write_text(text)
    result = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def unit_section(text: str, unit: str) -> dict[str, list[str]]:
    """KEY -> values of one systemd unit the worker script writes (`cat > .../UNIT <<UNIT ... UNIT`)."""
    body = text.split(f"/etc/systemd/system/{unit}\" <<UNIT\n", 1)[1].split("\nUNIT\n", 1)[0]
    found: dict[str, list[str]] = {}
    for line in body.replace("\\\\\n", " ").splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found
