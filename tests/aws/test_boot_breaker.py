"""The boot breaker: after BREAKER_LIMIT boots in a row that never joined, a job stops launching.

One table runs through the pure decision (petctl/core/boots.py) and through its bash twin in the worker's
boot script (`boots_never_joined`, over a fake bucket), so the two cannot drift; then the boot script
itself trips the breaker after three failed boots, and counts boots that hung (no record past the boot
timeout: their launch hook abandoned them) as a new boot starts."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from petctl.core.boots import (
    BREAKER_LIMIT,
    BootMark,
    boot_key,
    breaker,
    hung_error,
    parse_boot_key,
    stages,
    trip_reason,
)
from petctl.core.records import BootRecord, JobResult
from tests.support.aws.boot import IMAGE, worker
from tests.support.aws.boot_harness import INSTANCE, Boot

NOW, TIMEOUT = 100_000, 900
A, B, C, D = "i-0aaaaaaaaaaaaaaa1", "i-0bbbbbbbbbbbbbbb2", "i-0ccccccccccccccc3", "i-0ddddddddddddddd4"

# name -> (marks as (ts, instance, event), never_joined, tripped, newest never-joined instance)
CASES = {
    "nothing yet": ([], 0, False, ""),
    "three failures": ([(10, A, "started"), (20, A, "failed"), (30, B, "failed"), (40, C, "failed")],
                       3, True, C),
    "two failures": ([(20, A, "failed"), (30, B, "failed")], 2, False, B),
    "a join resets the count": ([(20, A, "failed"), (30, B, "failed"), (40, C, "joined"), (50, D, "failed")],
                                1, False, D),
    "a join counts when it happens, not when its boot started": (
        [(10, A, "started"), (20, B, "failed"), (30, C, "failed"), (35, D, "failed"), (90, A, "joined")],
        0, False, ""),
    "boots that hung past the timeout count": (
        [(10, A, "started"), (20, B, "started"), (30, C, "started"), (31, C, "installing")], 3, True, C),
    "boots still inside the timeout neither count nor reset": (
        [(20, A, "failed"), (30, B, "failed"), (NOW - 10, C, "started")], 2, False, B),
    "a joined instance whose agent failed later is a join": (
        [(100, A, "started"), (200, A, "joined"), (300, B, "failed"), (400, C, "failed"),
         (5000, A, "failed")], 2, False, C),
    "a failure and a join in the same second: the join is the later": (
        [(30, A, "failed"), (30, B, "failed"), (30, C, "failed"), (30, D, "joined")], 0, False, ""),
    "a hung boot among failures": ([(10, A, "started"), (NOW - 5, B, "failed"), (NOW - 4, C, "failed")],
                                   3, True, C),
}


def marks(rows) -> list[BootMark]:
    return [BootMark(ts, instance, event) for ts, instance, event in rows]


@pytest.mark.parametrize("case", list(CASES))
def test_breaker_table(case):
    rows, count, tripped, last = CASES[case]
    verdict = breaker(marks(rows), NOW, TIMEOUT)
    assert (verdict.never_joined, verdict.tripped, verdict.last_instance) == (count, tripped, last)
    assert verdict.limit == BREAKER_LIMIT == 3


def test_keys_name_the_time_the_instance_and_the_event():
    record = BootRecord(instance_id=A, event="failed", ts=1767322245.7, error="x")
    assert boot_key(record) == f"boots/1767322245.{A}.failed.json"
    assert parse_boot_key("jobs/demo/" + boot_key(record)) == BootMark(1767322245, A, "failed")
    for other in ("boots/1767322245.i-0abc.rebooted.json", "boots/notes.txt", "status/i-0abc.json"):
        assert parse_boot_key(other) is None


def test_stages_show_each_instances_newest_step():
    rows = [(10, A, "started"), (20, A, "installing"), (30, A, "joined"), (12, B, "started"),
            (40, B, "failed"), (41, B, "installing")]
    assert stages(marks(rows), launching=[A, C]) == {A: "joined", B: "failed", C: "launching"}


def shell_verdict(tmp_path, rows, now=NOW) -> tuple[int, str]:
    """`boots_never_joined NOW` from the rendered boot script, over a bucket holding `rows`' records."""
    boot = Boot(tmp_path)
    for ts, instance, event in rows:
        key = boot.s3 / "jobs/demo" / boot_key(BootRecord(instance_id=instance, event=event, ts=ts))
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_text("{}")
    script = tmp_path / "boot.sh"
    script.write_text(worker())
    cmd = f'. {script}; INSTANCE_ID={INSTANCE} REGION=us-west-2 TOKEN=t; boots_never_joined {now}'
    result = subprocess.run(["bash", "-c", cmd], env={**boot.env, "PETCTL_BOOT_LIB_ONLY": "1"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    fields = result.stdout.split()
    return int(fields[0]), fields[2] if len(fields) > 2 else ""


@pytest.mark.parametrize("case", list(CASES))
def test_the_boot_scripts_breaker_agrees_with_the_table(tmp_path, case):
    rows, count, _, last = CASES[case]
    assert shell_verdict(tmp_path, rows) == (count, last)


# --- the boot script trips it ---------------------------------------------------------------------------
def test_three_failed_boots_in_a_row_stop_the_job(tmp_path):
    """Three instances fail to pull, one after the other, against one bucket: the third ends the job
    `failed` with the reason and the last error, and sets its group's sizes to 0."""
    boot = Boot(tmp_path)
    for n, instance in enumerate((A, B, C)):
        boot.env["FAKE_INSTANCE"] = instance
        assert boot.run(worker(), docker_pull=99 * (n + 1)).returncode == 1
        stopped = boot.autoscaling("UpdateAutoScalingGroup")
        assert bool(stopped) is (n == 2), (n, stopped)
    (stop,) = boot.autoscaling("UpdateAutoScalingGroup")
    assert stop == {"Action": ["UpdateAutoScalingGroup"], "Version": ["2011-01-01"],
                    "AutoScalingGroupName": ["petctl-job-demo"], "MinSize": ["0"], "MaxSize": ["0"],
                    "DesiredCapacity": ["0"]}
    result = JobResult.from_json((boot.s3 / "jobs/demo/result.json").read_text())
    assert (result.state, result.node, result.job) == ("failed", C, "demo")
    assert result.reason == trip_reason(3, f"cannot pull {IMAGE}")
    # each boot abandoned its own launch
    assert [c["InstanceId"] for c in boot.autoscaling("CompleteLifecycleAction")] == [[A], [B], [C]]


def test_a_join_in_between_keeps_the_job(tmp_path):
    boot = Boot(tmp_path)
    for instance in (A, B, C, D):
        boot.env["FAKE_INSTANCE"] = instance
        if instance == C:  # C's agent joined (what petctl/agent/notices.py writes)
            record = BootRecord(instance_id=C, event="joined", ts=time.time())
            (boot.s3 / "jobs/demo" / boot_key(record)).write_text(record.to_json())
            continue
        boot.run(worker(), docker_pull=99)
    assert boot.autoscaling("UpdateAutoScalingGroup") == []
    assert not (boot.s3 / "jobs/demo/result.json").exists()


def test_a_boot_that_starts_after_three_hung_ones_stops_the_job(tmp_path):
    """Boots that hung never reach `fatal`; their launch hook abandons them. The next boot counts them."""
    boot = Boot(tmp_path)
    old = 1_000_000_000  # long before now
    for instance in (A, B, C):
        record = BootRecord(instance_id=instance, event="started", ts=old)
        path = boot.s3 / "jobs/demo" / boot_key(record)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(record.to_json())
    result = boot.run(worker())
    log = (boot.root / "var/log/petctl-boot.log").read_text()
    assert result.returncode == 1 and "FATAL: the boot breaker stopped job demo" in log
    assert boot.docker("pull") == 0  # it did not try to boot
    reason = JobResult.from_json((boot.s3 / "jobs/demo/result.json").read_text()).reason
    assert reason == trip_reason(3, hung_error(C, TIMEOUT))
    assert len(boot.autoscaling("UpdateAutoScalingGroup")) >= 1
    assert [c["LifecycleActionResult"] for c in boot.autoscaling("CompleteLifecycleAction")] == [["ABANDON"]]


def test_an_end_already_recorded_stands(tmp_path):
    boot = Boot(tmp_path)
    ended = JobResult(state="killed", reason="petctl kill_job", ts=1.0, job="demo", node="cli")
    (boot.s3 / "jobs/demo").mkdir(parents=True)
    (boot.s3 / "jobs/demo/result.json").write_text(ended.to_json())
    for instance in (A, B, C):
        boot.env["FAKE_INSTANCE"] = instance
        boot.run(worker(), docker_pull=99)
    assert json.loads((boot.s3 / "jobs/demo/result.json").read_text())["state"] == "killed"
    assert len(boot.autoscaling("UpdateAutoScalingGroup")) == 1  # still stopped
