"""Bad input gets one line on stderr, a non-zero exit, and leaves nothing behind: no job directory, no
etcd keys, no process. The checks run against a real setup (embedded etcd)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.cli import Petctl, assert_one_line_error

SLEEPER = "import time\ntime.sleep(600)\n"


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SLEEPER)
    return path


def run_job(cli: Petctl, *args: str, check: bool = False):
    return cli.run("run_job", *args, check=check)


def assert_left_nothing(cli: Petctl, job: str, etcd_pid_only: bool = True) -> None:
    assert not cli.job_dir(job).exists()
    if etcd_pid_only:
        assert len(cli.processes()) == 1, "only the embedded etcd may run"
    assert cli.json("jobs") == []


@pytest.mark.parametrize("args, needle", [
    (["--name", "bad", "--min", "3", "--max", "2"], "--min (3) is greater than --max (2)"),
    (["--name", "bad", "--min", "1", "--max", "2", "--size", "3"], "--size 3 is outside"),
    (["--name", "bad", "--min", "2", "--max", "3", "--size", "1"], "--size 1 is outside"),
    (["--name", "bad", "--min", "0", "--max", "2"], "--min must be >= 1"),
    (["--name", "Bad_Name", "--min", "1", "--max", "2"], "invalid job name"),
    (["--name", "bad", "--min", "1", "--max", "2", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["--name", "bad", "--min", "1", "--max", "2", "--max-restarts", "-1"], "--max-restarts"),
    (["--name", "bad", "--min", "1", "--max", "2", "--env", "NOEQUALS"], "KEY=VALUE"),
    (["--name", "bad", "--min", "1", "--max", "2", "--timeout", "nope=1"], "unknown timeout"),
    (["--name", "bad", "--min", "1", "--max", "2", "--timeout", "heartbeat_ttl=0"], "must be > 0"),
    (["--name", "bad", "--min", "1", "--max", "2", "--replace-delay", "-1"], "--replace-delay"),
    (["--name", "bad", "--min", "1", "--max", "2", "--instance-type", "g5.xlarge"],
     "--instance-type is not supported by the local provider"),
])
def test_bad_job_specs(shared_local: Petctl, script: Path, args: list[str], needle: str):
    assert_one_line_error(run_job(shared_local, *args, str(script)), needle)
    assert_left_nothing(shared_local, "bad")


def test_missing_script(shared_local: Petctl, tmp_path: Path):
    local = shared_local
    assert_one_line_error(run_job(local, "--name", "bad", "--min", "1", "--max", "1",
                                  str(tmp_path / "nope.py")), "script not found")
    code = tmp_path / "code"
    code.mkdir()
    assert_one_line_error(run_job(local, "--name", "bad", "--min", "1", "--max", "1", str(code)),
                          "--entrypoint")
    assert_one_line_error(run_job(local, "--name", "bad", "--min", "1", "--max", "1", "--entrypoint",
                                  "main.py", str(code)), "not found")
    assert_left_nothing(local, "bad")


@pytest.mark.parametrize("args", [
    ["status", "ghost"], ["hosts", "ghost"], ["logs", "ghost"], ["kill_job", "ghost"],
    ["scale", "ghost", "--size", "2"], ["chaos", "ghost", "--kill"],
])
def test_unknown_job(shared_local: Petctl, args: list[str]):
    local = shared_local
    proc = local.run(*args, check=False)
    assert_one_line_error(proc, "no job named 'ghost'")
    assert proc.returncode == 3
    assert_left_nothing(local, "ghost")


def test_duplicate_running_name_and_bad_steering(local: Petctl, script: Path):
    """One running job (a sleeping script: real agent, no torch) serves every 'job exists' check."""
    local.run("run_job", "--name", "dup", "--min", "1", "--max", "2", "--wait", str(script))
    # Steady state first: 10 s into a round that prints no steps, the agent refills its warm pool (one new
    # process, reported once). That is the agent's doing, not the bad commands', so wait for it.
    deadline = time.monotonic() + 60
    while not [e for e in local.events("dup", "workers.warm_ready") if e.get("round") is not None]:
        assert time.monotonic() < deadline, "the agent never refilled its warm pool"
        time.sleep(0.2)
    before = sorted(local.processes())
    meta_before = (local.job_dir("dup") / "job.json").read_text()

    proc = run_job(local, "--name", "dup", "--min", "1", "--max", "2", str(script))
    assert_one_line_error(proc, "job 'dup' is already running")
    assert_one_line_error(local.run("scale", "dup", "--size", "3", check=False), "outside [--min 1, --max 2]")
    assert_one_line_error(local.run("scale", "dup", "--size", "0", check=False), "outside")
    assert_one_line_error(local.run("chaos", "dup", check=False), "--kill")
    assert_one_line_error(local.run("chaos", "dup", "--node", "i-00000000", "--kill", check=False),
                          "no instance 'i-00000000'")
    assert_one_line_error(local.run("logs", "dup", "--node", "i-00000000", check=False), "no node")
    assert_one_line_error(local.run("teardown", check=False), "jobs still running: dup")

    # Nothing changed: same processes, same job, one instance.
    assert sorted(local.processes()) == before
    assert (local.job_dir("dup") / "job.json").read_text() == meta_before
    assert [h["state"] for h in local.json("hosts", "dup")] == ["running"]

    local.run("kill_job", "dup")
    assert local.status("dup")["state"] == "killed"
    assert len(local.processes()) == 1  # etcd only
    # A finished job's name can be used again.
    local.run("run_job", "--name", "dup", "--min", "1", "--max", "2", str(script))
    assert local.json("jobs")[0]["state"] == "running"


@pytest.mark.parametrize("option, needle", [
    ("agent_command=python agent.py", "must contain {config}"),
    ("agent_command=python 'unclosed", "not a command line"),
    ("region=us-east-1", "unknown local setup option(s) region"),
    ("store=v4", "store must be one of v3, v2"),
])
def test_bad_local_setup_options_set_nothing_up(petctl: Petctl, option: str, needle: str):
    assert_one_line_error(petctl.run("setup", "--option", option, check=False), needle)
    assert not (petctl.home / "local").exists() and petctl.processes() == []


@pytest.mark.parametrize("meta, backend", [
    ({"spec": {"etcd_store": "v3"}}, "v3"),
    ({"spec": {"etcd_store": "v2"}}, "v2"),
    ({"spec": {"name": "old"}}, "v2"),  # recorded before the store interface: its agents spoke v2 only
    ({}, "v2"),
    ({"spec": {"etcd_store": "v9"}}, "v2"),
])
def test_a_local_job_is_read_through_the_api_its_agents_write_with(meta, backend):
    from petctl.providers.local.provider import recorded_backend

    assert recorded_backend(meta) == backend
