"""Issue 43 on the local provider: a replacement is launched at once and boots `--replace-delay` seconds
(billed from launch), an instance may detach itself from its group (the local DetachInstances), and a
detached instance may end itself (the local power-off: billed until it asks, as EC2 bills until an
instance is shutting down): the endpoint's contract, the reconciler's launch decisions, and both through a
running reconciler with a stub agent (a process that only sleeps and leaves on SIGTERM)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from petctl.agent.imds import request_detach, request_end
from petctl.providers.local.metadata_server import LocalMetadataServer
from petctl.providers.local.reconciler import plan_launches
from tests.support.cli import Petctl
from tests.support.localstub import instance_events, instance_rows, reconciler_events, start, wait_hosts


# --- the reconciler's launch decisions (pure) -------------------------------------------------------
def test_a_short_group_launches_its_owed_replacements_and_fresh_ones_for_the_rest() -> None:
    todo = plan_launches(counted=1, desired=3, owed=["i-lost"], live_total=1, max_size=4)
    assert (todo.replacements, todo.fresh, todo.owed) == (["i-lost"], 1, [])


def test_a_full_group_launches_nothing_and_forgets_replacements_it_no_longer_needs() -> None:
    # Scaled in meanwhile (or the booting replacement already counts): nothing owed any more.
    todo = plan_launches(counted=2, desired=2, owed=["i-lost"], live_total=2, max_size=4)
    assert (todo.replacements, todo.fresh, todo.owed) == ([], 0, [])


def test_a_detached_replacement_may_exceed_the_max_by_the_allowance_only() -> None:
    # max 2, desired 2: the detached instance still runs (3 live with its replacement: 1 over, allowed).
    todo = plan_launches(counted=1, desired=2, owed=["i-det"], live_total=2, max_size=2)
    assert (todo.replacements, todo.fresh, todo.owed) == (["i-det"], 0, [])
    # Two detached at once: the second replacement would be 2 over the max; it waits for room.
    todo = plan_launches(counted=0, desired=2, owed=["i-a", "i-b"], live_total=2, max_size=2)
    assert (todo.replacements, todo.fresh, todo.owed) == (["i-a"], 0, ["i-b"])


# --- the endpoint ---------------------------------------------------------------------------------------
def _post(url: str, headers: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(url, method="POST", headers=headers, data=b"")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def _token(base: str) -> str:
    req = urllib.request.Request(base + "/latest/api/token", method="PUT", data=b"",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode()


def test_detach_needs_the_instances_own_token_and_is_idempotent(tmp_path: Path) -> None:
    asked: list[str] = []
    known = {"i-a"}

    def on_detach(iid: str) -> bool:
        asked.append(iid)
        return iid in known

    with LocalMetadataServer(tmp_path / "notices", on_detach=on_detach) as server:
        base = server.endpoint_for("i-a")
        url = base + "/latest/petctl/detach"
        assert _post(url, {})[0] == 401
        assert _post(url, {"X-aws-ec2-metadata-token": "forged"})[0] == 401
        other = _token(server.endpoint_for("i-b"))  # a token is the instance's own
        assert _post(url, {"X-aws-ec2-metadata-token": other})[0] == 401
        assert asked == []  # nothing reached the reconciler without a valid token
        tok = _token(base)
        assert _post(url, {"X-aws-ec2-metadata-token": tok}) == (200, '{"detached": true}')
        assert _post(url, {"X-aws-ec2-metadata-token": tok}) == (200, '{"detached": true}')
        assert _post(base + "/latest/petctl/other", {"X-aws-ec2-metadata-token": tok})[0] == 404
        # An instance the reconciler does not know is not found.
        b = server.endpoint_for("i-b")
        assert _post(b + "/latest/petctl/detach", {"X-aws-ec2-metadata-token": other})[0] == 404
        # The client: a token, then the POST; True on success, False (never an exception) otherwise.
        assert request_detach(base) is True
        assert request_detach(b) is False
    assert asked == ["i-a", "i-a", "i-b", "i-a", "i-b"]


def test_end_needs_the_instances_own_token_and_the_reconcilers_yes(tmp_path: Path) -> None:
    detached = {"i-a"}  # the reconciler ends a detached instance only: the group ends the others

    with LocalMetadataServer(tmp_path / "notices", on_detach=lambda iid: True,
                             on_end=lambda iid: iid in detached) as server:
        base, b = server.endpoint_for("i-a"), server.endpoint_for("i-b")
        url = base + "/latest/petctl/end"
        assert _post(url, {})[0] == 401
        assert _post(url, {"X-aws-ec2-metadata-token": _token(b)})[0] == 401
        tok = _token(base)
        assert _post(url, {"X-aws-ec2-metadata-token": tok}) == (200, '{"ending": true}')
        assert request_end(base) is True and request_end(base) is True
        assert request_end(b) is False  # not detached: refused, never raised
    with LocalMetadataServer(tmp_path / "notices") as server:  # no reconciler behind it: as on EC2, 404
        assert request_end(server.endpoint_for("i-a")) is False
    assert request_end("http://127.0.0.1:9/i-a", timeout=0.5) is False


def test_detach_without_a_reconciler_or_an_endpoint_is_false(tmp_path: Path) -> None:
    with LocalMetadataServer(tmp_path / "notices") as server:  # no detach callback: as on EC2, 404
        assert request_detach(server.endpoint_for("i-a")) is False
    assert request_detach("http://127.0.0.1:9/i-a", timeout=0.5) is False  # nothing listens
    assert request_detach("not a url") is False


# --- through a reconciler -------------------------------------------------------------------------------
def _rows(cli: Petctl, name: str) -> list[dict[str, Any]]:
    return cli.json("hosts", name, "--all")


def _imds(cli: Petctl, name: str, iid: str) -> str:
    return json.loads((cli.job_dir(name) / "instances" / iid / "agent.json").read_text())["imds_endpoint"]


def test_a_detached_instance_is_replaced_at_once_and_its_exit_is_no_loss(stub: Petctl) -> None:
    import os
    import signal

    start(stub, "det", "--size", "2", "--replace-delay", "2")
    first = [r["host_id"] for r in wait_hosts(stub, "det", lambda rows: sum(
        r["state"] == "running" for r in rows) == 2)]
    victim = first[0]
    t0 = time.time()
    assert request_detach(_imds(stub, "det", victim)) is True
    rows = wait_hosts(stub, "det", lambda rows: len(rows) == 3, timeout=5)
    states = {r["host_id"]: r["state"] for r in rows}
    (new,) = set(states) - set(first)
    # detached, still running. The replacement is booting, or has booted if this listing took longer
    # than its 2 s boot (a loaded machine): its boot is pinned below by the reconciler's own times, and
    # its pending state by test_a_booting_replacement_is_stopped_cleanly_when_the_job_ends (a 60 s boot).
    assert states[victim] == "detached" and states[new] in ("pending", "running")
    launched = {e["instance"]: e for e in reconciler_events(stub, "det", "instance.launched")}[new]
    assert launched["ts"] - t0 < 1.0 and launched["boot_s"] == 2.0 and launched["replaces"] == victim
    (detached,) = reconciler_events(stub, "det", "instance.detached")
    assert detached["instance"] == victim
    assert request_detach(_imds(stub, "det", victim)) is True  # idempotent: the same answer, no launch

    wait_hosts(stub, "det", lambda rows: {r["host_id"]: r["state"] for r in rows}[new] == "running")
    info = instance_rows(stub, "det")
    assert info[new]["booted_at"] - info[new]["launched_at"] >= 2.0
    (booted,) = [e for e in reconciler_events(stub, "det", "instance.booted") if e["instance"] == new]
    assert booted["boot_s"] >= 2.0

    # The detached instance ends itself (the stub leaves on SIGTERM, exit 0): not a loss, no launch.
    os.kill(info[victim]["pid"], signal.SIGTERM)
    wait_hosts(stub, "det", lambda rows: {r["host_id"]: r["state"] for r in rows}[victim] == "terminated")
    time.sleep(2.5)  # longer than a replacement's boot
    rows = _rows(stub, "det")
    assert len(rows) == 3 and sum(r["state"] == "running" for r in rows) == 2
    assert len(reconciler_events(stub, "det", "instance.launched")) == 3
    row = instance_rows(stub, "det")[victim]
    assert row["reason"] == "detached, then exited with code 0" and row["ended_at"] >= row["detached_at"]
    stub.run("kill_job", "det")


def test_a_booting_replacement_is_stopped_cleanly_when_the_job_ends(stub: Petctl) -> None:
    start(stub, "boot", "--size", "1", "--replace-delay", "60")
    (victim,) = [r["host_id"] for r in wait_hosts(stub, "boot", lambda rows: len(rows) == 1
                                                  and rows[0]["state"] == "running")]
    stub.run("chaos", "boot", "--kill")
    rows = wait_hosts(stub, "boot", lambda rows: any(r["state"] == "pending" for r in rows))
    (new,) = [r["host_id"] for r in rows if r["state"] == "pending"]
    assert stub.json("jobs")[0]["state"] == "running"
    stub.run("kill_job", "boot")
    row = instance_rows(stub, "boot")[new]
    assert row["state"] == "terminated" and row["reason"] == "job killed while booting"
    assert row["booted_at"] is None and row["pid"] == 0 and row["ended_at"] >= row["launched_at"]
    assert not (stub.job_dir("boot") / "instances" / new / "agent.log").exists()  # its agent never ran
    assert len(stub.processes()) == 1  # etcd only


def test_the_start_and_scale_ups_start_agents_at_once(stub: Petctl) -> None:
    start(stub, "up", "--size", "1", "--replace-delay", "30")
    wait_hosts(stub, "up", lambda rows: [r["state"] for r in rows] == ["running"])
    stub.run("scale", "up", "--size", "2")
    wait_hosts(stub, "up", lambda rows: [r["state"] for r in rows] == ["running", "running"], timeout=10)
    assert [e["boot_s"] for e in reconciler_events(stub, "up", "instance.launched")] == [0.0, 0.0]
    stub.run("kill_job", "up")


def test_a_detached_instance_with_a_notice_is_reclaimed_at_its_time_and_not_replaced_twice(
        stub: Petctl) -> None:
    # The agent's flow on a spot notice: the notice, then the detach; here it never leaves by itself.
    start(stub, "spot", "--size", "1", "--replace-delay", "0.5")
    (victim,) = [r["host_id"] for r in wait_hosts(stub, "spot", lambda rows: len(rows) == 1
                                                  and rows[0]["state"] == "running")]
    stub.run("chaos", "spot", "--node", victim, "--notice", "--grace", "3")
    reclaim_at = json.loads((stub.job_dir("spot") / "notices" / f"{victim}.json").read_text())["time"]
    assert request_detach(_imds(stub, "spot", victim)) is True
    wait_hosts(stub, "spot", lambda rows: {r["host_id"]: r["state"] for r in rows}.get(victim) == "terminated"
               and sum(r["state"] == "running" for r in rows) == 1)
    time.sleep(1.5)  # longer than a replacement's boot: nothing more is launched
    row = instance_rows(stub, "spot")[victim]
    assert row["reason"] == "detached, then spot-reclaimed" and row["ended_at"] >= reclaim_at
    launched = reconciler_events(stub, "spot", "instance.launched")
    assert len(launched) == 2 and launched[1]["replaces"] == victim and launched[1]["ts"] < reclaim_at
    stub.run("kill_job", "spot")


def test_a_detached_instance_that_ends_itself_is_billed_until_it_asks_and_never_reclaimed(
        stub: Petctl) -> None:
    """The agent's flow after a notice's save: detach, leave, then end its instance. Its agent's teardown
    (here the stub's 4 s after SIGTERM) runs past the reclaim time; the instance is billed until its
    request, as EC2 stops billing once an instance is shutting down, and the reclaim never comes."""
    start(stub, "end", "--size", "1", "--replace-delay", "0.5", "--env", "STUB_TERM_DELAY=4")
    (victim,) = [r["host_id"] for r in wait_hosts(stub, "end", lambda rows: len(rows) == 1
                                                  and rows[0]["state"] == "running")]
    imds = _imds(stub, "end", victim)
    assert request_end(imds) is False  # still in its group: the group ends it, not itself
    stub.run("chaos", "end", "--node", victim, "--notice", "--grace", "3")
    reclaim_at = json.loads((stub.job_dir("end") / "notices" / f"{victim}.json").read_text())["time"]
    assert request_detach(imds) is True
    asked = time.time()
    assert request_end(imds) is True
    (sigterm,) = _wait(lambda: instance_events(stub, "end", victim, "stub.sigterm"), 5)
    assert sigterm["ts"] - asked < 2.0  # stopped as a power-off stops a host's services
    wait_hosts(stub, "end", lambda rows: {r["host_id"]: r["state"] for r in rows}.get(victim) == "terminated")
    row = instance_rows(stub, "end")[victim]
    assert row["reason"] == "detached, then ended by its agent"
    assert asked <= row["shutdown_at"] == row["ended_at"] < asked + 1.0 < reclaim_at
    (ended,) = [e for e in reconciler_events(stub, "end", "instance.terminated") if e["instance"] == victim]
    assert ended["ts"] >= reclaim_at  # the process outlived the reclaim time, and was not reclaimed:
    assert not reconciler_events(stub, "end", "instance.reclaimed")
    (shutting,) = reconciler_events(stub, "end", "instance.shutting_down")
    assert shutting["instance"] == victim
    stub.run("kill_job", "end")


def _wait(read, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := read()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return found
