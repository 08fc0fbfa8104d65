"""The lost-node drill every snapshot-loss test runs (tests/e2e/test_node_loss.py: DDP,
tests/e2e/test_sharded_node_loss.py: FSDP2, both tests/workloads/user_train.py;
tests/e2e/test_framework_node_loss.py: the HF Trainer and Lightning examples): a job of 3 local-provider
nodes, one node (a random rank) SIGKILLed with its agent at a random step, and the checks of what the
script's ledger and the agents' snapshot directories show after."""

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
from petctl.io.eventlog import EventLog
from tests.support.cli import Petctl
from tests.support.matrix import FAST, wait_until
from tests.support.userledger import UserLedger, end_padding, slow_padding
from tests.workloads.padding import SLOWED_STEP

WARM_WAIT = 45.0


@pytest.fixture
def snapshot_root() -> Iterator[Path]:
    """A tmpfs root of the test's own (the agents' directories go under it), removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"petctl-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class Drill:
    """One lost-node drill: a job of 3 local-provider nodes (min 2, no replacement) running `script`, one
    node killed at a random step `offsets` past the drill's start point. The start point is either the
    warm pools full (`after_step` None: the steady state of a job that ran for a while) or rank 0 past
    step `after_step` at world 3 (a framework's first periodic checkpoint: memory must beat a file that
    exists). At the kill the job must still have more than `margin` steps to go."""

    job: str
    script: Path
    script_args: tuple[str, ...]
    steps: int
    step_time: float
    offsets: tuple[int, int] = (3, 60)  # random.randrange's bounds
    margin: int = 150
    after_step: int | None = None
    launch_timeout: float = 120  # run_job's --wait-timeout: the workers' imports
    finish_timeout: float = 300  # from the kill to the job's end


@dataclass
class Kill:
    why: str  # "seed S: SIGKILL of rank R's node at step N", for every assertion message
    victim: str  # the node killed
    victim_rank: int
    at: float  # when the signal went (time.time()): the chaos marker's mtime, written just before it


def run_and_kill_one(local: Petctl, drill: Drill, ledger_dir: Path, snapshot_root: Path, seed: int) -> Kill:
    """Start the drill's job, wait for its start point (the warm pools: bounded, the steps lost do not
    depend on it), SIGKILL a random rank's node at a random step (anywhere within it)."""
    rng = random.Random(seed)
    offset, victim_rank = rng.randrange(*drill.offsets), rng.randrange(3)
    local.env["PETCTL_SNAPSHOT_ROOT"] = str(snapshot_root)
    local.run("run_job", "--name", drill.job, *FAST, "--min", "2", "--max", "3", "--size", "3",
              "--replace-delay", "600", "--env", f"LEDGER_DIR={ledger_dir}", "--wait",
              "--wait-timeout", str(drill.launch_timeout), str(drill.script), "--", *drill.script_args,
              "--step-time", str(drill.step_time))
    if drill.after_step is None:
        deadline = time.monotonic() + WARM_WAIT
        while len(local.events(drill.job, "workers.warm_ready")) < 6 and time.monotonic() < deadline:
            time.sleep(0.5)
    else:
        wait_until(lambda: (UserLedger.read(ledger_dir).last_step(world=3) or -1) >= drill.after_step, 240,
                   f"step {drill.after_step} at world 3", every=0.05)
    kill_at = (UserLedger.read(ledger_dir).last_step(world=3) or 0) + offset
    why = f"seed {seed}: SIGKILL of rank {victim_rank}'s node at step {kill_at}"
    assert kill_at < drill.steps - drill.margin, f"{why}: the job got too far before the kill"
    wait_until(lambda: (UserLedger.read(ledger_dir).last_step(world=3) or -1) >= kill_at - 2, 180,
               f"step {kill_at - 2} at world 3 ({why})", every=0.02)
    # The two CLI calls that deliver the kill take seconds on a loaded box: 40 steps or more at 0.05 s,
    # time enough for a job to finish first. Steps of SLOWED_STEP from here (`finish` ends the padding).
    slow_padding(ledger_dir)
    wait_until(lambda: (UserLedger.read(ledger_dir).last_step(world=3) or -1) >= kill_at, 60,
               f"step {kill_at} at world 3 ({why})", every=0.02)
    time.sleep(rng.uniform(0, SLOWED_STEP))
    (victim,) = [node for node, rank in local.status(drill.job)["ranks"].items() if rank == victim_rank]
    local.run("chaos", drill.job, "--node", victim, "--kill")
    # Not the time the CLI was called: it takes seconds to start on a loaded box, steps in which the
    # snapshot interval in force may change.
    t_kill = (local.job_dir(drill.job) / "instances" / victim / "chaos").stat().st_mtime
    return Kill(why, victim, victim_rank, t_kill)


def finish(local: Petctl, drill: Drill, tmp_path: Path, ledger_dir: Path,
           kill: Kill) -> tuple[dict, UserLedger, str]:
    """Wait for the job's end (its state, the ledger, its story for messages), the agents' logs kept in
    `tmp_path` for a post-mortem.

    Once rank 0 has done a step at world 2 after the kill (the survivors re-formed and resumed: all the
    drill asserts on happened at the padded step), the rest of the run goes unpadded
    (tests/workloads/padding.py): those steps only have to be done, and done right."""
    deadline = time.monotonic() + drill.finish_timeout
    while time.monotonic() < deadline and not any(
            e["world"] == 2 and e["ts"] > kill.at for e in UserLedger.read(ledger_dir).of("step")):
        time.sleep(0.1)
    end_padding(ledger_dir)
    info = local.wait_finished(drill.job, timeout=max(deadline - time.monotonic(), 1.0))
    for log in local.job_dir(drill.job).glob("instances/*/agent.log"):
        shutil.copy(log, tmp_path / f"{log.parent.name}.log")
    ledger = UserLedger.read(ledger_dir)
    return info, ledger, f"{kill.why}; {ledger.story()}"


def finished_ledger(local: Petctl, drill: Drill, tmp_path: Path, ledger_dir: Path, kill: Kill,
                    expected: tuple[float, ...], tolerance: float) -> tuple[UserLedger, str]:
    """`finish`, then check the job succeeded, every step was done and the final weights are those of an
    uninterrupted run within `tolerance`. (The ledger, its story for messages.)"""
    info, ledger, story = finish(local, drill, tmp_path, ledger_dir, kill)
    assert info["state"] == "succeeded", (info, story)
    assert not ledger.missing(drill.steps), f"steps never done: {ledger.missing(drill.steps)[:10]}; {story}"
    dw = max(abs(a - b) for a, b in zip(expected, ledger.final_weights(), strict=True))
    assert dw <= tolerance, f"final weights differ from an uninterrupted run: max |dw| = {dw:.3g}; {story}"
    return ledger, story


def steps_a_loss_may_cost(local: Petctl, job: str, kill: Kill) -> int:
    """K: the snapshot interval in force at the kill, the largest any node had (docs/elastic.md: a node
    lost without warning costs at most K steps). K is 1 unless the cadence raised it: a snapshot that
    costs the training thread more than its share of a step, as it does on a machine loaded past the
    figures in the tests' docstrings, makes K larger, and each change is a `snapshot.every` event, said
    once the snapshot the new K follows is committed (both tiers). This reads them as the
    fault soak's oracle does (bench/soakoracle.every_at)."""
    from bench.soak import cadence_of
    from bench.soakoracle import every_at

    events = local.events(job, "snapshot.enabled") + local.events(job, "snapshot.every")
    cadences = [cadence_of(e, e["node"]) for e in events]
    return every_at(cadences, {c.node for c in cadences}, kill.at)


def check_memory_covered_the_loss(local: Petctl, job: str, kill: Kill, source: str, story: str) -> None:
    """The resume after the kill came from the snapshots, or from the store only because the store was
    newer than a whole snapshot: never from the periodic checkpoint because no snapshot was whole.

    When the load raised K above 1, the store's periodic save can land between two snapshots (steps
    reached 41, the newest whole snapshot 38, the store's 39: pass 31 of the e2e tier). The job then takes
    the store, which is the newest state anywhere; the caller's bound on steps redone still holds. The
    choice says so in `snapshot.passed_over` (DDP) or `snapshot.fallback` (sharded), with both steps."""
    if source == "snapshot":
        return
    said = [e for kind in ("snapshot.passed_over", "snapshot.fallback") for e in local.events(job, kind)
            if e["ts"] > kill.at]
    assert said, f"resumed from {source!r} and no snapshot choice was reported: {story}"
    first = min(said, key=lambda e: e["ts"])
    whole, store = first.get("snapshot_step"), first.get("store_step")
    assert whole is not None and store is not None and store > whole, (
        f"resumed from {source!r}, not from a whole snapshot: {first}; {story}")


def check_only_the_victims_snapshots_left(snapshot_root: Path, victim: str) -> None:
    """Every agent removed its snapshots but the killed one (it could not): the next agent's sweep does."""
    left = sorted(snapshot_root.iterdir())
    killed = [p for p in left if f".{victim}." in p.name]
    assert left == killed and len(killed) == 1, f"snapshots outlived the job: {left} (victim {victim})"
    assert sweep(snapshot_root, EventLog("test")) == killed and not list(snapshot_root.iterdir())
