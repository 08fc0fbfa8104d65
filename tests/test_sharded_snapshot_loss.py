"""Issue 16, sharded state: a node lost without warning costs at most one step under FSDP too.

One of 3 nodes is SIGKILLed (agent and worker at once, as a vanished host) at a random step of a user's
FSDP2 script (tests/workloads/user_train.py --fsdp: `ShardedCheckpointer(every=20)` + `ShardedState`,
gloo, no snapshot option: the defaults). Every rank holds only its shard of the state, so the survivors can
resume only because each node also kept the previous node's shard: the killed node's shard comes from
the next node's memory, and the 2 survivors reshard the 3 shards. No replacement is launched.

From the script's own step ledger: every step done, at most one computed twice, the final weights those
of an uninterrupted single-process run (max |dw| <= 1e-9: the gradient averages over 3, 2 and 1 ranks
round differently in float64), and the resume after the kill came from the snapshots
(`snapshot.resume`), not from the periodic checkpoint up to 19 steps older. The kill step and the
victim's rank are random; the seed is in every assertion message (PETCTL_TEST_SEED=<seed> repeats it).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path

import pytest

from petctl.agent.snapshots import sweep
from petctl.core.eventlog import EventLog
from tests.conftest import Petctl
from tests.matrix import FAST, wait_until
from tests.userledger import USER_SCRIPT, UserLedger, replay

pytestmark = pytest.mark.slow

STEPS = 800
WARM_WAIT = 45.0
EVERY = 20
STEP_TIME = 0.05
GLOBAL_BATCH = 24  # splits over 3 ranks and over the 2 survivors
TOLERANCE = 1e-9


def script_args() -> tuple[str, ...]:
    return ("--fsdp", "--steps", str(STEPS), "--ckpt-every", str(EVERY), "--global-batch", str(GLOBAL_BATCH))


@pytest.fixture
def snapshot_root() -> Path:
    """A tmpfs root of this test's own (the agents' directories go under it), removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"petctl-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(480)
def test_a_node_killed_at_a_random_step_costs_at_most_one_sharded_step(local: Petctl, tmp_path: Path,
                                                                       snapshot_root: Path) -> None:
    seed = int(os.environ.get("PETCTL_TEST_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    offset, victim_rank = rng.randrange(3, 60), rng.randrange(3)
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    local.env["PETCTL_SNAPSHOT_ROOT"] = str(snapshot_root)
    local.run("run_job", "--name", "shsnap", *FAST, "--min", "2", "--max", "3", "--size", "3",
              "--replace-delay", "600", "--env", f"LEDGER_DIR={ledger_dir}", "--wait",
              "--wait-timeout", "120", str(USER_SCRIPT), "--", *script_args(), "--step-time", str(STEP_TIME))
    deadline = time.monotonic() + WARM_WAIT  # steady state first, as in test_snapshot_loss.py
    while len(local.events("shsnap", "workers.warm_ready")) < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    kill_at = (UserLedger.read(ledger_dir).last_step(world=3) or 0) + offset
    why = f"seed {seed}: SIGKILL of rank {victim_rank}'s node at step {kill_at}"
    assert kill_at < STEPS - 150, f"{why}: the job got too far before the kill"
    wait_until(lambda: (UserLedger.read(ledger_dir).last_step(world=3) or -1) >= kill_at, 180,
               f"step {kill_at} at world 3 ({why})", every=0.02)
    time.sleep(rng.uniform(0, STEP_TIME))  # anywhere within the step
    ranks = local.status("shsnap")["ranks"]
    (victim,) = [node for node, rank in ranks.items() if rank == victim_rank]
    t_kill = time.time()
    local.run("chaos", "shsnap", "--node", victim, "--kill")

    info = local.wait_finished("shsnap", timeout=300)
    for log in local.job_dir("shsnap").glob("instances/*/agent.log"):  # kept for a post-mortem
        shutil.copy(log, tmp_path / f"{log.parent.name}.log")
    ledger = UserLedger.read(ledger_dir)
    story = f"{why}; {ledger.story()}"
    assert info["state"] == "succeeded", (info, story)
    assert not ledger.missing(STEPS), f"steps never done: {ledger.missing(STEPS)[:10]}; {story}"
    expected, final = replay(*script_args()), ledger.final_weights()
    dw = max(abs(a - b) for a, b in zip(expected, final, strict=True))
    assert dw <= TOLERANCE, f"final weights differ from an uninterrupted run: max |dw| = {dw:.3g}; {story}"
    redone = ledger.redone()

    lines = local.events("shsnap", "snapshot.resume") + local.events("shsnap", "snapshot.fallback")
    resumes = [e for e in lines if e["ts"] > t_kill]
    assert resumes, story
    first = min(resumes, key=lambda e: e["ts"])
    stats = local.events("shsnap", "snapshot.stats")
    print(json.dumps({"seed": seed, "kill_at": kill_at, "victim_rank": victim_rank, "event": first["event"],
                      "resumed_step": first.get("step"), "holders": first.get("holders"),
                      "redone": sorted(redone), "back_after_s": round(first["ts"] - t_kill, 2),
                      "every": sorted({s["every"] for s in stats}),
                      "blocked_ms": sorted(s["blocked_ms"] for s in stats), "rounds": ledger.story()}))
    assert len(redone) <= 1, f"{why}: the loss cost more than one step: {ledger.describe_redone()}"
    assert first["event"] == "snapshot.resume" and first["world"] == 3, (first, story)
    assert not local.events("shsnap", "snapshot.disabled"), story
    left = sorted(snapshot_root.iterdir())
    killed = [p for p in left if f".{victim}." in p.name]
    assert left == killed and len(killed) == 1, f"snapshots outlived the job: {left} (victim {victim})"
    assert sweep(snapshot_root, EventLog("test")) == killed and not list(snapshot_root.iterdir())
