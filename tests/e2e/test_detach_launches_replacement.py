"""Issue 43 end to end on the local provider, real agents and torch workers (examples/train_ddp.py): an
instance detaches itself through its metadata endpoint; the group launches its replacement at once,
whose agent starts after `--replace-delay` of boot; the group never counts the detached instance, whose
own exit launches nothing; and `status` bills every instance from its launch to its end."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from petctl.agent.imds import request_detach
from tests.support.cli import Petctl
from tests.support.localjobs import FAST, TRAIN, formed

pytestmark = pytest.mark.slow

BOOT = 3.0


def rows(cli: Petctl, job: str) -> list[dict]:
    try:
        return json.loads((cli.job_dir(job) / "instances.json").read_text())
    except (OSError, ValueError):
        return []


def recorded(cli: Petctl, job: str, event: str) -> list[dict]:
    lines = (cli.job_dir(job) / "reconciler.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == event]


@pytest.mark.timeout(300)
def test_a_detached_instance_is_replaced_at_once_and_billed_until_its_exit(local: Petctl) -> None:
    local.run("run_job", "--name", "det", "--min", "1", "--max", "3", "--size", "2", "--replace-delay",
              str(BOOT), *FAST, "--wait", "--wait-timeout", "120", TRAIN, "--",
              "--steps", "1000000", "--ckpt-every", "5", "--step-time", "0.05")
    status = local.wait_status("det", formed(2), 90, "a 2-node world")
    victim = max(status["ranks"], key=status["ranks"].get)

    # Watch the group's count all along: live, not detached instances (booting ones included).
    counts: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            counts.append(sum(1 for r in rows(local, "det") if r["state"] in ("booting", "running", "frozen")
                              and not r.get("detached_at")))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        endpoint = json.loads((local.job_dir("det") / "instances" / victim / "agent.json").read_text())[
            "imds_endpoint"]
        t0 = time.time()
        assert request_detach(endpoint) is True
        deadline = time.monotonic() + 5
        while not (launched := [e for e in recorded(local, "det", "instance.launched")
                                if e.get("replaces") == victim]):
            assert time.monotonic() < deadline, "no replacement launched"
            time.sleep(0.05)
        (launch,) = launched
        assert launch["ts"] - t0 < 1.0 and launch["boot_s"] == BOOT
        new = launch["instance"]
        (detached,) = recorded(local, "det", "instance.detached")
        assert detached["instance"] == victim and detached["ts"] <= launch["ts"]
        assert request_detach(endpoint) is True  # idempotent: the same answer, nothing more launched

        # Its agent starts after the boot; the job grows onto it (max 3): the detached one still trains.
        local.wait_status("det", lambda s: new in s["ranks"], 90, "the replacement in the round")
        (booted,) = [e for e in recorded(local, "det", "instance.booted") if e["instance"] == new]
        assert booted["ts"] - launch["ts"] >= BOOT
        row = {r["id"]: r for r in rows(local, "det")}[new]
        assert row["booted_at"] - row["launched_at"] >= BOOT

        # The detached instance ends itself (its agent leaves and exits): not a loss, nothing launched.
        pid = {r["id"]: r for r in rows(local, "det")}[victim]["pid"]
        os.kill(pid, signal.SIGTERM)
        local.wait_status("det", formed(2), 60, "the two counted instances training on")
        deadline = time.monotonic() + 20
        while (row := {r["id"]: r for r in rows(local, "det")}[victim])["state"] != "terminated":
            assert time.monotonic() < deadline, "the detached instance did not end"
            time.sleep(0.1)
        assert row["reason"] == "detached, then exited with code 0"
        time.sleep(2 * BOOT)
        assert len(recorded(local, "det", "instance.launched")) == 3
    finally:
        stop.set()
        watcher.join()
    assert counts and max(counts) == 2 and counts[-1] == 2  # never 3: the detached one was not counted

    local.run("kill_job", "det")
    final = rows(local, "det")
    billed = sum(r["ended_at"] - r["launched_at"] for r in final)
    accounting = local.status("det")["accounting"]
    assert accounting["billing_basis"] == "provider"
    assert accounting["instance_hours"] * 3600 == pytest.approx(billed, abs=0.01)
    # The replacement's boot is in it: billed before its agent started.
    agent_started = [e for e in local.events("det", "agent.started") if e["node"] == new]
    assert agent_started and agent_started[0]["ts"] - row_of(final, new)["launched_at"] >= BOOT
    assert len(local.processes()) == 1


def row_of(final: list[dict], iid: str) -> dict:
    return next(r for r in final if r["id"] == iid)
