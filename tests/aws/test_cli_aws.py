"""The CLI drives the AWS provider exactly as it drives the local one (no provider branches): every
command once, against moto, through click, with the options the CLI passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from petctl.core.errors import PetctlError
from petctl.io.config import PetctlConfig
from tests.support.aws.account import REGION, boto, publish_dlami, write_script


@pytest.fixture
def petctl(moto, aws_env):
    from petctl.cli.group import cli

    runner = CliRunner()

    def run(*args: str, ok: bool = True):
        result = runner.invoke(cli, list(args), catch_exceptions=True)
        if ok:
            assert result.exit_code == 0, (args, result.output, result.exception)
        return result

    return run


# S3 operations whose IAM action has another name (Service Authorization Reference, Amazon S3).
S3_ACTIONS = {"ListObjectsV2": "ListBucket", "ListObjects": "ListBucket", "HeadObject": "GetObject",
              "HeadBucket": "ListBucket", "DeleteObjects": "DeleteObject",
              "CreateMultipartUpload": "PutObject",
              "UploadPart": "PutObject", "CompleteMultipartUpload": "PutObject",
              "AbortMultipartUpload": "AbortMultipartUpload", "ListObjectVersions": "ListBucketVersions"}


@pytest.fixture
def cli_calls(monkeypatch):
    """The IAM actions of the AWS calls petctl's CLI makes (not the agent's, not the tests' own), while
    `recording` is set: every botocore call, its caller found on the stack."""
    import sys

    from botocore.client import BaseClient

    root = str(Path(__file__).resolve().parents[2] / "petctl")
    agent = str(Path(root) / "agent")
    state = {"recording": False, "actions": set()}
    original = BaseClient._make_api_call

    def record(self, operation, params):
        if state["recording"]:
            frame = sys._getframe(1)
            while frame and any(lib in frame.f_code.co_filename for lib in ("/botocore/", "/boto3/")):
                frame = frame.f_back
            where = frame.f_code.co_filename if frame else ""
            if where.startswith(root) and not where.startswith(agent):
                prefix = self.meta.service_model.signing_name
                action = S3_ACTIONS.get(operation, operation) if prefix == "s3" else operation
                state["actions"].add(f"{prefix}:{action}")
        return original(self, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", record)
    return state


def test_every_command_through_the_cli(petctl, moto, aws_env, tmp_path, stack_name, etcd_mirror, cli_calls):
    out = petctl(
        "setup",
        "--provider",
        "aws",
        "--region",
        REGION,
        "--endpoint-url",
        moto,
        "--option",
        f"stack_name={stack_name}",
    ).output
    assert "petctl is set up (aws)" in out and "https://10.42.0.10:2379" in out
    settings = PetctlConfig.load().section("aws")
    assert settings["image"] == ""  # nothing to build: jobs boot the Deep Learning AMI
    publish_dlami(moto)
    cli_calls["recording"] = True  # everyday use, after setup's administrator-level run

    script = write_script(tmp_path / "src")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("einops>=0.7  # what the script imports\n")
    petctl(
        "run_job",
        "--name",
        "cli",
        "--min",
        "1",
        "--max",
        "3",
        "--size",
        "2",
        "--instance-type",
        "g5.xlarge",
        "--instance-type",
        "g5.2xlarge",
        "--on-demand-base",
        "1",
        "--spot-strategy",
        "capacity-optimized",
        "--timeout",
        "heartbeat_interval=3",
        "--requirements",
        str(requirements),
        str(script),
        "--",
        "--lr",
        "0.1",
    )
    jobs = json.loads(petctl("jobs", "-o", "json").output)
    assert [(j["name"], j["desired"], j["provider"]) for j in jobs] == [("cli", 2, "aws")]
    agent = boto(moto, "s3").get_object(Bucket=settings["outputs"]["BucketName"], Key="jobs/cli/agent.json")
    job = json.loads(agent["Body"].read())["job"]
    assert job["instance_types"] == ["g5.xlarge", "g5.2xlarge"] and job["on_demand_base"] == 1
    assert job["spot_strategy"] == "capacity-optimized" and job["multi_az"] is False
    # AWS's heartbeat defaults (a networked etcd), under the user's --timeout overrides
    assert (job["timeouts"]["heartbeat_ttl"], job["timeouts"]["heartbeat_interval"]) == (10.0, 3.0)
    assert job["args"] == ["--lr", "0.1"] and job["entrypoint"] == "train.py"
    house = boto(moto, "s3").list_objects_v2(Bucket=settings["outputs"]["BucketName"],
                                             Prefix="jobs/cli/wheelhouse/")["Contents"]
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in house)
    assert names[0].startswith("petctl-0.1.0+") and names[0].endswith("-py3-none-any.whl")
    assert names[1:] == ["requirements.txt"]

    hosts = json.loads(petctl("hosts", "cli", "-o", "json").output)
    assert len(hosts) == 2 and {h["state"] for h in hosts} == {"running"}
    petctl("scale", "cli", "--size", "3")
    assert json.loads(petctl("jobs", "-o", "json").output)[0]["desired"] == 3
    killed = petctl("chaos", "cli", "--kill").output.split()[-1]
    assert killed.startswith("i-")
    frozen = petctl("chaos", "cli", "--freeze", ok=False)
    assert frozen.exit_code != 0 and "not supported on aws" in str(frozen.exception)
    petctl("status", "cli")
    petctl("kill_job", "cli")
    # a killed job stays on record (its S3 prefix), its capacity is gone
    assert [(j["name"], j["state"]) for j in json.loads(petctl("jobs", "-o", "json").output)] == [
        ("cli", "killed")
    ]
    petctl("doctor", "--provider", "aws", ok=False)  # moto lacks some of its APIs: SKIP, maybe FAIL
    cli_calls["recording"] = False
    # Issue 44.7: every call petctl made for those commands is one `doctor` simulates for the operator
    # and docs/aws.md lists ("The operator's IAM permissions").
    from petctl.providers.aws.doctor import OPERATOR_ACTIONS

    assert len(cli_calls["actions"]) > 20
    assert sorted(cli_calls["actions"] - set(OPERATOR_ACTIONS)) == []
    docs = (Path(__file__).resolve().parents[2] / "docs" / "aws.md").read_text()
    section = docs.split("### The operator's IAM permissions", 1)[1].split("\n### ", 1)[0]
    assert [a for a in sorted(cli_calls["actions"]) if a.split(":")[1] not in section] == []
    petctl("teardown")
    assert PetctlConfig.load().section("aws")["ready"] is False


def test_cli_reports_unknown_setup_options(petctl, moto):
    result = petctl(
        "setup", "--provider", "aws", "--option", f"region={REGION}", "--option", "zone=x", ok=False
    )
    assert isinstance(result.exception, PetctlError) and "unknown aws setup option" in str(result.exception)


@pytest.mark.parametrize("args", [["--provider", "aws", "--etcd-nodes", "2"],
                                  ["--provider", "aws", "--etcd-nodes", "three"],
                                  ["--etcd-nodes", "3"]])
def test_cli_etcd_nodes_is_1_or_3_on_aws(args, tmp_path, monkeypatch):
    """A one-line error and a non-zero exit, before any AWS call (no endpoint is even configured)."""
    import subprocess
    import sys

    env = {"PETCTL_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin",
           "AWS_EC2_METADATA_DISABLED": "true"}
    out = subprocess.run([sys.executable, "-m", "petctl", "setup", *args], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    expected = "--etcd-nodes is for `--provider aws`" if "aws" not in args else "--etcd-nodes must be 1 or 3"
    assert expected in line


def test_cli_refuses_a_bad_store_option_before_anything_exists(tmp_path):
    """`--option store=` is v3 or v2: anything else is one line and a non-zero exit, before any AWS call
    (no endpoint is even configured) and with nothing recorded."""
    import subprocess
    import sys

    home = tmp_path / "home"
    env = {"PETCTL_HOME": str(home), "PATH": "/usr/bin:/bin", "AWS_EC2_METADATA_DISABLED": "true"}
    out = subprocess.run([sys.executable, "-m", "petctl", "setup", "--provider", "aws", "--option",
                          f"region={REGION}", "--option", "store=etcd2"], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "aws setup option store must be one of v3, v2, not 'etcd2'" in line
    assert not PetctlConfig.load(home).section("aws").get("ready")
