"""The lost-node drill both snapshot-loss tests run (tests/test_snapshot_loss.py: DDP,
tests/test_sharded_snapshot_loss.py: FSDP2): a job of 3 local-provider nodes running tests/workloads/
user_train.py, one node (a random rank) SIGKILLed with its agent at a random step once the warm pools
are full, and the checks of what the script's ledger and the agents' snapshot directories show after."""

from __future__ import annotations

import random
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from petctl.agent.snapshots import sweep
from petctl.core.eventlog import EventLog
from tests.support.cli import Petctl
from tests.support.matrix import FAST, wait_until
from tests.support.userledger import USER_SCRIPT, UserLedger

WARM_WAIT = 45.0


@pytest.fixture
def snapshot_root() -> Iterator[Path]:
    """A tmpfs root of the test's own (the agents' directories go under it), removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"petctl-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Kill:
    why: str  # "seed S: SIGKILL of rank R's node at step N", for every assertion message
    victim: str  # the node killed
    at: float  # when (time.time())


def run_and_kill_one(local: Petctl, job: str, ledger_dir: Path, snapshot_root: Path, seed: int,
                     script_args: tuple[str, ...], steps: int, step_time: float) -> Kill:
    """Start `job` (3 nodes, min 2, no replacement), wait for the warm pools (bounded: the steps lost
    do not depend on it), SIGKILL a random rank's node at a random step (anywhere within it)."""
    rng = random.Random(seed)
    offset, victim_rank = rng.randrange(3, 60), rng.randrange(3)
    local.env["PETCTL_SNAPSHOT_ROOT"] = str(snapshot_root)
    local.run("run_job", "--name", job, *FAST, "--min", "2", "--max", "3", "--size", "3",
              "--replace-delay", "600", "--env", f"LEDGER_DIR={ledger_dir}", "--wait",
              "--wait-timeout", "120", str(USER_SCRIPT), "--", *script_args, "--step-time", str(step_time))
    deadline = time.monotonic() + WARM_WAIT
    while len(local.events(job, "workers.warm_ready")) < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    kill_at = (UserLedger.read(ledger_dir).last_step(world=3) or 0) + offset
    why = f"seed {seed}: SIGKILL of rank {victim_rank}'s node at step {kill_at}"
    assert kill_at < steps - 150, f"{why}: the job got too far before the kill"
    wait_until(lambda: (UserLedger.read(ledger_dir).last_step(world=3) or -1) >= kill_at, 180,
               f"step {kill_at} at world 3 ({why})", every=0.02)
    time.sleep(rng.uniform(0, step_time))
    (victim,) = [node for node, rank in local.status(job)["ranks"].items() if rank == victim_rank]
    t_kill = time.time()
    local.run("chaos", job, "--node", victim, "--kill")
    return Kill(why, victim, t_kill)


def finished_ledger(local: Petctl, job: str, tmp_path: Path, ledger_dir: Path, kill: Kill, steps: int,
                    expected: tuple[float, ...], tolerance: float) -> tuple[UserLedger, str]:
    """Wait for the job's end; check it succeeded, every step was done and the final weights are those
    of an uninterrupted run within `tolerance`. (The ledger, its story for messages.)"""
    info = local.wait_finished(job, timeout=300)
    for log in local.job_dir(job).glob("instances/*/agent.log"):  # kept for a post-mortem
        shutil.copy(log, tmp_path / f"{log.parent.name}.log")
    ledger = UserLedger.read(ledger_dir)
    story = f"{kill.why}; {ledger.story()}"
    assert info["state"] == "succeeded", (info, story)
    assert not ledger.missing(steps), f"steps never done: {ledger.missing(steps)[:10]}; {story}"
    dw = max(abs(a - b) for a, b in zip(expected, ledger.final_weights(), strict=True))
    assert dw <= tolerance, f"final weights differ from an uninterrupted run: max |dw| = {dw:.3g}; {story}"
    return ledger, story


def check_only_the_victims_snapshots_left(snapshot_root: Path, victim: str) -> None:
    """Every agent removed its snapshots but the killed one (it could not): the next agent's sweep does."""
    left = sorted(snapshot_root.iterdir())
    killed = [p for p in left if f".{victim}." in p.name]
    assert left == killed and len(killed) == 1, f"snapshots outlived the job: {left} (victim {victim})"
    assert sweep(snapshot_root, EventLog("test")) == killed and not list(snapshot_root.iterdir())
