"""What the default boot takes from the Deep Learning AMI, and from the OS it runs on (issue 44.3, 44.4,
44.6): the worker's home, its file limit, the AMI's Python, pip and AWS CLI. The rendered AMI boot script
runs for real in tests/support/aws/boot_harness.py's fake instance, with a fake AMI Python on it."""

from __future__ import annotations

import json

import pytest

from petctl.providers.aws.boot import PYTHON_FLOOR, AmiBoot, worker_boot_script
from tests.support.aws.boot import agent_config, unit_section
from tests.support.aws.boot_harness import INSTANCE, Boot

WHEEL_URL = "s3://b/jobs/demo/wheelhouse/petctl-0.1.0+abcdef012345-py3-none-any.whl"

# The AMI's Python: `-c` runs in the host's python3 with the version it claims; `-m pip`/`-m ensurepip`
# answer as told. Every call is logged.
FAKE_PYTHON = r"""#!/bin/bash
what="$1"; [ "$1" = -m ] && what="$1 $2"
echo "{\"cmd\": \"python\", \"args\": \"$what\"}" >> "$FAKE_LOG"
case "$1 $2" in
  "-m pip") [ -e "$FAKE_DIR/has-pip" ] || exit 1; [ "$3" = --version ] && exit 0; exit 1 ;;
  "-m ensurepip") [ -n "$FAKE_ENSUREPIP" ] || exit 1; touch "$FAKE_DIR/has-pip" ;;
  -c*) case "$2" in
         *"sys.version_info < ("*) [ "$FAKE_PY_OK" = 1 ] ;;
         *"sys.version_info[:2]"*) echo "$FAKE_PY_VERSION" ;;
         *) exit 1 ;;
       esac ;;
  *) exit 1 ;;
esac
"""
CLI_V1 = ('#!/bin/bash\n[ "$1" = --version ] && { echo "aws-cli/1.18.147 Python/2.7.18" >&2; exit 0; }\n'
          'exit 2\n')
CLI_V2 = ('#!/bin/bash\n[ "$1" = --version ] && { echo "aws-cli/2.31.0 Python/3.13.7"; exit 0; }\n'
          'echo "{\\"cmd\\": \\"aws\\", \\"args\\": \\"$*\\"}" >> "$FAKE_LOG"\nexit 1\n')


def ami_script() -> str:
    boot = AmiBoot(wheel_url=WHEEL_URL)
    return worker_boot_script(agent_config(), image="", log_group="/petctl/petctl",
                              config_url="s3://b/jobs/demo/agent.json", ami_boot=boot).text


@pytest.fixture
def ami(tmp_path) -> Boot:
    boot = Boot(tmp_path)
    python = boot.root / "opt/pytorch/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return boot


def run(ami: Boot, *, version: str = "3.12", pip: bool = True, ensurepip: bool = False, cli: str = CLI_V2):
    (ami.dir / "fakes" / "aws").write_text(cli)
    if pip:
        (ami.dir / "has-pip").touch()
    ok = tuple(int(p) for p in version.split(".")) >= PYTHON_FLOOR
    ami.env.update(FAKE_PY_VERSION=version, FAKE_PY_OK="1" if ok else "0",
                   FAKE_ENSUREPIP="1" if ensurepip else "")
    return ami.run(ami_script())


def failure(ami: Boot) -> str:
    """The error of the boot's `failed` record in the job's prefix, and that its launch was abandoned."""
    (record,) = [p for p in (ami.s3 / "jobs/demo/boots").glob("*.json") if p.name.endswith(".failed.json")]
    (call,) = ami.autoscaling("CompleteLifecycleAction")
    assert call["LifecycleActionResult"] == ["ABANDON"] and call["InstanceId"] == [INSTANCE]
    return json.loads(record.read_text())["error"]


# --- the worker's home and its limits (44.3, 44.4) --------------------------------------------------------
def test_the_worker_user_gets_a_writable_home_and_the_unit_says_so():
    text = ami_script()
    assert ("useradd --system --create-home --home-dir /var/lib/petctl --shell /sbin/nologin petctl"
            in text)
    owned = 'install -d -m 0755 -o petctl -g petctl "$ROOT/var/lib/petctl" "$ROOT/var/lib/petctl/work" '
    assert owned + '"$ROOT/var/lib/petctl/.cache"' in text  # also when the user or directory was there
    unit = unit_section(text, "petctl-agent.service")
    assert unit["User"] == ["petctl"]
    assert "HOME=/var/lib/petctl" in unit["Environment"][0].split()


def test_the_agent_unit_raises_the_open_file_limit():
    unit = unit_section(ami_script(), "petctl-agent.service")
    assert unit["LimitNOFILE"] == ["1048576"]  # Docker's default; systemd's soft 1024 starves DataLoader


def test_a_booted_worker_has_its_home_and_cache_directories(ami):
    run(ami)  # it fails later (no wheel in the fake bucket): the directories come first
    for path in ("var/lib/petctl", "var/lib/petctl/.cache", "var/lib/petctl/work"):
        assert (ami.root / path).is_dir(), path
    (useradd,) = ami.calls("useradd")
    assert "--create-home" in useradd["args"].split()


# --- what the AMI must have (44.6) ------------------------------------------------------------------------
def test_an_ami_python_older_than_petctls_floor_fails_the_boot_in_one_line(ami):
    result = run(ami, version="3.10")
    assert result.returncode == 1
    error = failure(ami)
    assert "/opt/pytorch/bin/python is Python 3.10; petctl needs >=3.11" in error and "\n" not in error
    assert not [c for c in ami.calls("python") if c["args"].startswith("-m pip")]  # nothing installed


def test_an_ami_without_pip_gets_it_from_ensurepip(ami):
    run(ami, pip=False, ensurepip=True)
    args = [c["args"] for c in ami.calls("python")]
    assert "-m ensurepip" in args
    assert "has no pip" not in (ami.dir / "root/var/log/petctl-boot.log").read_text(errors="replace")
    assert [c for c in ami.calls("aws") if c["args"].startswith("s3 cp")]  # went on to fetch the wheel


def test_an_ami_with_neither_pip_nor_ensurepip_fails_the_boot(ami):
    assert run(ami, pip=False, ensurepip=False).returncode == 1
    assert "has no pip, and ensurepip cannot install one" in failure(ami)


def test_an_ami_without_aws_cli_v2_fails_the_boot_before_fetching_anything(ami):
    assert run(ami, cli=CLI_V1).returncode == 1
    assert "no AWS CLI v2 on root's PATH (found: aws-cli/1.18.147" in failure(ami)
    assert not [c for c in ami.calls("aws") if c["args"].startswith("s3 cp")]
