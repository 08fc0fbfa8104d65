"""The reconciler as an Auto Scaling group, driven through the CLI with a stub agent (a process that
only sleeps and leaves on SIGTERM), so capacity behaviour is checked fast and apart from the agent's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import closing

from petctl.io.procs import host_cores
from tests.support.cli import Petctl, assert_one_line_error
from tests.support.localstub import (
    hosts,
    instance_events,
    instance_rows,
    reconciler_events,
    running,
    start,
    wait_hosts,
)


def test_replaces_lost_instances_and_follows_desired(stub: Petctl):
    start(stub, "asg", "--size", "2", "--replace-delay", "1.5")
    first = running(wait_hosts(stub, "asg", lambda rows: len(running(rows)) == 2))
    for iid in first:  # each instance has its own work dir, config and log
        config = json.loads((stub.job_dir("asg") / "instances" / iid / "agent.json").read_text())
        assert config["node_id"] == iid and config["work_dir"].endswith(f"{iid}/work")
        assert config["job"]["code_url"].startswith("file://")
        # Its host's share of this machine's cores: --max 3 instances of 1 worker share them.
        (started,) = instance_events(stub, "asg", iid, "stub.started")
        assert started["omp"] == str(max(1, host_cores() // 3))

    # kill: the instance goes, and a new one (new id) replaces it no sooner than the delay.
    killed = stub.run("chaos", "asg", "--kill").stdout.split()[-1]
    assert killed in first
    rows = wait_hosts(stub, "asg", lambda rows: len(running(rows)) == 2 and killed not in running(rows))
    replacement = (set(running(rows)) - set(first)).pop()
    info = instance_rows(stub, "asg")
    assert info[killed]["state"] == "terminated"
    assert info[killed]["reason"] == "chaos-kill: killed by SIGKILL"
    # As an ASG does: launched (billed) at once, its agent started after the boot (the replace delay).
    assert info[replacement]["launched_at"] - info[killed]["ended_at"] < 1.0
    assert info[replacement]["booted_at"] - info[replacement]["launched_at"] >= 1.5
    assert info[replacement]["replaces"] == killed

    # freeze / unfreeze are visible as instance states; a frozen instance still counts as capacity.
    frozen = stub.run("chaos", "asg", "--freeze").stdout.split()[-1]
    wait_hosts(stub, "asg", lambda rows: {r["host_id"]: r["state"] for r in rows}[frozen] == "frozen")
    stub.run("chaos", "asg", "--unfreeze", "--node", frozen)
    wait_hosts(stub, "asg", lambda rows: len(running(rows)) == 2 and frozen in running(rows))

    # scale out launches at once; scale in SIGTERMs the newest (the agent leaves gracefully).
    stub.run("scale", "asg", "--size", "3")
    three = running(wait_hosts(stub, "asg", lambda rows: len(running(rows)) == 3))
    newest = max(three, key=lambda iid: instance_rows(stub, "asg")[iid]["launched_at"])
    stub.run("scale", "asg", "--size", "2")
    rows = wait_hosts(stub, "asg", lambda rows: len(running(rows)) == 2)
    assert newest not in running(rows)
    assert instance_rows(stub, "asg")[newest]["reason"] == "scale-in"
    assert "stub.sigterm" in (stub.job_dir("asg") / "instances" / newest / "agent.log").read_text()
    time.sleep(2.0)  # longer than the replace delay: a scale-in is not replaced
    assert len(running(hosts(stub, "asg"))) == 2
    assert [e["desired"] for e in reconciler_events(stub, "asg", "scale.changed")] == [3, 2]

    # term: a graceful leave that the ASG replaces.
    termed = stub.run("chaos", "asg", "--term").stdout.split()[-1]
    wait_hosts(stub, "asg", lambda rows: len(running(rows)) == 2 and termed not in running(rows))
    assert instance_rows(stub, "asg")[termed]["reason"] == "chaos-term: exited with code 0"

    # kill_job: the result is recorded and every process of the job is gone when it returns.
    stub.run("kill_job", "asg")
    assert stub.status("asg")["state"] == "killed"
    assert len(stub.processes()) == 1  # etcd only
    assert all(r["state"] == "terminated" for r in instance_rows(stub, "asg").values())
    assert_one_line_error(stub.run("scale", "asg", "--size", "1", check=False), "is killed")


def test_a_named_instance_freezes_and_thaws_while_etcd_is_stopped(stub: Petctl):
    """The soak left a node frozen for 290 s: its thaw came while etcd was down, and `chaos` read the
    job's round first, which a named instance does not need, so the thaw failed. By name, chaos needs
    no etcd."""
    start(stub, "away", "--size", "1")
    (node,) = running(wait_hosts(stub, "away", lambda rows: len(running(rows)) == 1))
    etcd = int(json.loads((stub.home / "config.json").read_text())["settings"]["local"]["etcd_pid"])
    os.kill(etcd, signal.SIGSTOP)
    try:
        def state_becomes(state: str) -> bool:  # as the reconciler records it, read from the job's directory
            deadline = time.time() + 10
            while instance_rows(stub, "away")[node]["state"] != state and time.time() < deadline:
                time.sleep(0.1)
            return instance_rows(stub, "away")[node]["state"] == state

        stub.run("chaos", "away", "--freeze", "--node", node, timeout=30)
        assert state_becomes("frozen")
        stub.run("chaos", "away", "--unfreeze", "--node", node, timeout=30)
        assert state_becomes("running")
    finally:
        os.kill(etcd, signal.SIGCONT)
    stub.run("kill_job", "away")


def test_notice_is_enforced_at_its_time(stub: Petctl):
    start(stub, "spot", "--size", "1", "--replace-delay", "0.5")
    (victim,) = running(wait_hosts(stub, "spot", lambda rows: len(running(rows)) == 1))
    t0 = time.time()
    stub.run("chaos", "spot", "--notice", "--grace", "2")
    t1 = time.time()
    notice = json.loads((stub.job_dir("spot") / "notices" / f"{victim}.json").read_text())
    # The command reads the clock somewhere between its start and its end (which, loaded, is seconds).
    assert notice["kind"] == "spot" and t0 + 2 <= notice["time"] <= t1 + 2
    assert victim in running(hosts(stub, "spot"))  # still there during the grace period
    wait_hosts(stub, "spot", lambda rows: victim not in running(rows) and len(running(rows)) == 1)
    row = instance_rows(stub, "spot")[victim]
    assert row["reason"] == "spot-reclaimed" and row["returncode"] == -9
    assert row["ended_at"] >= notice["time"]


def test_a_second_notice_to_a_departing_instance_is_refused(stub: Petctl):
    start(stub, "twice", "--size", "1")
    (victim,) = running(wait_hosts(stub, "twice", lambda rows: len(running(rows)) == 1))
    stub.run("chaos", "twice", "--notice", "--grace", "600")
    path = stub.job_dir("twice") / "notices" / f"{victim}.json"
    notice = json.loads(path.read_text())
    assert_one_line_error(stub.run("chaos", "twice", "--node", victim, "--notice", check=False),
                          f"instance {victim} of job 'twice' already has a notice")
    # By default too: no round has formed (stub agents), and the only instance is leaving.
    assert_one_line_error(stub.run("chaos", "twice", "--notice", check=False), "pending notice")
    assert json.loads(path.read_text()) == notice  # its reclaim time did not move
    stub.run("kill_job", "twice")


def test_job_result_stops_the_reconciler_and_ends_logs_follow(stub: Petctl):
    from petctl.io.jobresult import write_result

    start(stub, "done", "--size", "2")
    ids = running(wait_hosts(stub, "done", lambda rows: len(running(rows)) == 2))
    follower = subprocess.Popen([sys.executable, "-m", "petctl", "logs", "done", "-f"], env=stub.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with closing(stub.store()) as store:
            write_result(store, "done", "succeeded", "all workers exited 0")
        out, err = follower.communicate(timeout=30)  # `logs -f` ends by itself once the job is over
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err
    assert len(stub.processes()) == 1  # the reconciler stopped every instance, then itself
    assert [j["state"] for j in stub.json("jobs")] == ["succeeded"]
    assert json.loads((stub.job_dir("done") / "job.json").read_text())["state"] == "succeeded"
    assert reconciler_events(stub, "done", "reconciler.exit")[0]["state"] == "succeeded"
    for iid in ids:  # each node's lines, prefixed with its id, through to its SIGTERM at the end
        mine = [line for line in out.splitlines() if line.startswith(f"[{iid}] ")]
        assert "stub.started" in mine[0] and "stub.sigterm" in mine[-1], mine
    node_log = stub.run("logs", "done", "--node", ids[0]).stdout
    assert node_log.startswith("{") and "stub.started" in node_log
    assert "instance.launched" in stub.run("logs", "done", "--node", "reconciler").stdout


def test_crash_looping_instances_fail_the_job(stub: Petctl):
    start(stub, "crashy", "--size", "1", "--replace-delay", "0.1", "--env", "STUB_EXIT=3")
    assert stub.wait_finished("crashy", timeout=30)["state"] == "failed"
    state = stub.status("crashy")
    assert state["state"] == "failed"
    assert "exited within" in state["reason"] and "exited with code 3" in state["reason"]
    assert len(stub.processes()) == 1


def test_a_lost_reconciler_takes_its_instances_with_it(stub: Petctl):
    import os
    import signal

    start(stub, "lost", "--size", "2")
    ids = running(wait_hosts(stub, "lost", lambda rows: len(running(rows)) == 2))
    reconciler = json.loads((stub.job_dir("lost") / "job.json").read_text())["reconciler"]["pid"]
    os.kill(reconciler, signal.SIGKILL)  # no chance to clean up: the agents must notice by themselves
    deadline = time.monotonic() + 15
    while len(stub.processes()) > 1:
        assert time.monotonic() < deadline, "agents outlived their reconciler"
        time.sleep(0.1)
    for iid in ids:  # they were told (SIGTERM) and left, rather than being killed
        assert "stub.sigterm" in (stub.job_dir("lost") / "instances" / iid / "agent.log").read_text()
    (job,) = stub.json("jobs")
    assert job["state"] == "unknown" and "reconciler is not running" in job["reason"]
    stub.run("kill_job", "lost")
    assert stub.json("jobs")[0]["state"] == "killed"
