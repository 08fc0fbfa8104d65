"""End to end, as a user runs it: the CLI, the local provider, real agents, real etcd and real torch
(gloo) workers training examples/train_ddp.py. Outcomes are read back from `petctl status -o json`,
`petctl hosts -o json` and the workers' own step/checkpoint events in the node logs."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import Petctl
from tests.support.localjobs import FAST, TRAIN, formed, world  # noqa: F401

pytestmark = pytest.mark.slow

def node_of_rank(status: dict[str, Any], rank: int) -> str:
    return next(node for node, r in status["ranks"].items() if r == rank)


def wait_for_step(cli: Petctl, job: str, since: float, world_size: int, timeout: float) -> dict[str, Any]:
    """The first `train.step` logged after `since` by a world of `world_size`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in cli.events(job, "train.step"):
            if e["ts"] > since and e["world_size"] == world_size:
                return e
        time.sleep(0.2)
    raise AssertionError(f"no step at world size {world_size} within {timeout}s")


def assert_steps_never_go_back_past_a_checkpoint(cli: Petctl, job: str) -> int:
    """Replay rank 0's steps and the checkpoints in time order; return how many resumes were seen."""
    events = [e for e in cli.events(job) if e["event"] in ("train.step", "train.resumed", "checkpoint.saved")
              and e.get("rank", 0) == 0]
    last_ckpt, prev_step, resumes = 0, 0, 0
    for e in events:
        if e["event"] == "checkpoint.saved":
            last_ckpt = max(last_ckpt, e["step"])
        elif e["event"] == "train.resumed":
            resumes += 1
            assert e["step"] >= last_ckpt, f"resumed from {e['step']}, older than checkpoint {last_ckpt}"
            prev_step = e["step"]
        else:
            if e["step"] <= prev_step:  # a restart: training went back, but never past the newest checkpoint
                assert e["step"] > last_ckpt, (e, last_ckpt)
            prev_step = e["step"]
    assert prev_step > 0
    return resumes


@pytest.mark.timeout(420)
def test_elastic_job_survives_kill_freeze_and_scales(local: Petctl):
    local.run("run_job", "--name", "el", "--min", "1", "--max", "3", "--size", "2", "--max-restarts", "20",
              "--replace-delay", "5", *FAST, "--wait", "--wait-timeout", "120", TRAIN, "--",
              "--steps", "1000000", "--ckpt-every", "5", "--step-time", "0.05")

    # 1. Two nodes form one world: ranks {0, 1}, world size 2, and they train.
    status = local.wait_status("el", formed(2), 60, "a 2-node world")
    first = set(status["ranks"])
    assert {h["host_id"] for h in local.json("hosts", "el")} == first
    wait_for_step(local, "el", 0, 2, 60)

    # 2. Kill rank 1: the survivor re-forms alone (min 1), then the reconciler's replacement rejoins.
    victim = node_of_rank(status, 1)
    local.run("chaos", "el", "--node", victim, "--kill")
    status = local.wait_status("el", formed(1), 30, "the survivor alone at world size 1")
    assert victim not in status["ranks"]
    status = local.wait_status("el", formed(2), 60, "the replacement back at world size 2")
    wait_for_step(local, "el", time.time(), 2, 60)
    replacement = (set(status["ranks"]) - first).pop()
    assert victim not in status["ranks"]
    hosts = {h["host_id"]: h for h in local.json("hosts", "el", "--all")}
    assert hosts[victim]["state"] == "terminated" and hosts[replacement]["state"] == "running"

    # 3. Freeze rank 1 (a hung host, sockets open): it is dropped and training resumes within 15 s.
    frozen = node_of_rank(status, 1)
    t0 = time.time()
    local.run("chaos", "el", "--node", frozen, "--freeze")
    step = wait_for_step(local, "el", t0, 1, 15)
    assert step["ts"] - t0 < 15
    status = local.wait_status("el", formed(1), 10, "world size 1 without the frozen node")
    assert frozen not in status["ranks"]
    assert {h["host_id"]: h["state"] for h in local.json("hosts", "el")}[frozen] == "frozen"
    # ... and when it thaws it rejoins as a new member.
    local.run("chaos", "el", "--node", frozen, "--unfreeze")
    status = local.wait_status("el", formed(2), 60, "the thawed node back at world size 2")
    assert frozen in status["ranks"]
    wait_for_step(local, "el", time.time(), 2, 60)

    # 4. Scale 2 -> 3.
    local.run("scale", "el", "--size", "3")
    status = local.wait_status("el", formed(3), 60, "world size 3 after scale")
    assert status["desired"] == 3 and len(local.json("hosts", "el")) == 3
    wait_for_step(local, "el", time.time(), 3, 60)

    # 5. Across all of it the step counter never went back past the newest checkpoint.
    assert assert_steps_never_go_back_past_a_checkpoint(local, "el") >= 3

    local.run("kill_job", "el")
    assert local.status("el")["state"] == "killed"
    assert len(local.processes()) == 1  # etcd only: no agent, worker or reconciler left


@pytest.mark.timeout(240)
def test_job_succeeds_when_its_workers_finish(local: Petctl):
    local.run("run_job", "--name", "ok", "--min", "2", "--max", "2", *FAST, TRAIN, "--", "--steps", "20",
              "--ckpt-every", "5")
    info = local.wait_finished("ok", timeout=150)
    assert info["state"] == "succeeded", info
    assert local.status("ok")["state"] == "succeeded"
    done = local.events("ok", "train.done")
    assert [e["step"] for e in done] == [20] and done[0]["world_size"] == 2
    assert max(e["step"] for e in local.events("ok", "checkpoint.saved")) == 20
    assert (local.job_dir("ok") / "checkpoints" / "checkpoint.pt").exists()
    assert len(local.processes()) == 1  # the reconciler exited and took every instance with it
    assert keyspaces_holding(local, "ok") == ["v3"]  # the default backend wrote it, and only it


def keyspaces_holding(cli: Petctl, job: str) -> list[str]:
    """The etcd APIs whose keyspace holds the job's result (etcd 3.5 keeps v2's and v3's apart)."""
    from petctl.core.keys import JobKeys
    from petctl.core.store import BACKENDS
    from tests.support.store import store_for

    settings = cli.local_settings()
    found = []
    for backend in BACKENDS:
        with contextlib.closing(store_for(settings["etcd_endpoint"], cli.etcd_root_tls(), backend)) as kv:
            if kv.get(JobKeys(job).result) is not None:
                found.append(backend)
    return found


@pytest.mark.timeout(300)
def test_setup_option_store_v2_runs_the_same_job_through_python_etcd(petctl: Petctl):
    """`petctl setup --option store=v2`: the job's agents, reconciler and readers use etcd's v2 API, and
    the job ends as it does on v3 (every status read through v2)."""
    petctl.run("setup", "--option", "store=v2")
    assert petctl.local_settings()["store"] == "v2"
    petctl.run("run_job", "--name", "old", "--min", "2", "--max", "2", *FAST, TRAIN, "--", "--steps", "10",
               "--ckpt-every", "5")
    info = petctl.wait_finished("old", timeout=150)
    assert info["state"] == "succeeded", info
    status = petctl.status("old")
    assert status["state"] == "succeeded" and status["source"] == "etcd", status
    assert [e["step"] for e in petctl.events("old", "train.done")] == [10]
    assert keyspaces_holding(petctl, "old") == ["v2"]


@pytest.mark.timeout(240)
def test_max_restarts_exhaustion_fails_the_job(local: Petctl, tmp_path: Path):
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('crashing on purpose', flush=True)\nsys.exit(7)\n")
    local.run("run_job", "--name", "crashy", "--min", "1", "--max", "2", "--size", "2", "--max-restarts",
              "2", *FAST, str(crash))
    info = local.wait_finished("crashy", timeout=150)
    assert info["state"] == "failed", info
    status = local.status("crashy")
    assert status["state"] == "failed"
    assert "max_restarts=2 exhausted" in status["reason"]
    assert len(local.processes()) == 1


@pytest.mark.timeout(240)
def test_spot_notice_leaves_gracefully_before_the_reclaim(local: Petctl):
    local.run("run_job", "--name", "spot", "--min", "1", "--max", "2", "--size", "2", "--replace-delay", "2",
              *FAST, "--wait", "--wait-timeout", "120", TRAIN, "--", "--steps", "1000000",
              "--ckpt-every", "5", "--step-time", "0.05")
    status = local.wait_status("spot", formed(2), 60, "a 2-node world")
    wait_for_step(local, "spot", 0, 2, 60)

    victim = node_of_rank(status, 1)
    local.run("chaos", "spot", "--node", victim, "--notice", "--grace", "10")
    reclaim_at = json.loads((local.job_dir("spot") / "notices" / f"{victim}.json").read_text())["time"]
    # The agent saw the notice on its metadata endpoint, took its instance out of the group (the
    # replacement is launched at once), handed off and left before the reclaim (tests/e2e/test_spot_handoff.py
    # covers when it hands off); the job goes on at 2 with the replacement.
    status = local.wait_status("spot", lambda s: victim not in s["ranks"] and formed(len(s["ranks"]))(s), 20,
                               "the noticed node gone before its reclaim")
    assert time.time() < reclaim_at
    (left,) = [e for e in local.events("spot", "agent.left") if e["node"] == victim]
    assert left["cause"] == "preemption" and left["ts"] < reclaim_at
    # Detached, it ended its own instance once it had left: the reconciler records that, and no reclaim.
    def recorded():
        rows = {r["id"]: r for r in json.loads((local.job_dir("spot") / "instances.json").read_text())}
        return rows[victim] if rows[victim].get("reason") else None

    deadline = time.monotonic() + 15
    while (row := recorded()) is None:
        assert time.monotonic() < deadline, "the reconciler never recorded why the instance ended"
        time.sleep(0.3)
    assert row["reason"] == "detached, then ended by its agent" and row["ended_at"] < reclaim_at, row
    assert row["detached_at"] <= row["shutdown_at"] == row["ended_at"], row  # billed until it asked to end
    assert not [e for e in local.json("events", "spot", "--all") if e["event"] == "instance.reclaimed"]
    local.wait_status("spot", lambda s: formed(2)(s) and victim not in s["ranks"], 30,
                      "the replacement in the job")

    local.run("kill_job", "spot")
    assert len(local.processes()) == 1
