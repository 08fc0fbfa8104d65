"""Issue 16, sharded state: a node lost without warning costs at most one step under FSDP too.

One of 3 nodes is SIGKILLed (agent and worker at once, as a vanished host) at a random step of a user's
FSDP2 script (tests/workloads/user_train.py --fsdp: `ShardedCheckpointer(every=20)` + `ShardedState`,
gloo, no snapshot option: the defaults). Every rank holds only its shard of the state, so the survivors
can resume only because each node also kept the previous node's shard: the killed node's shard comes
from the next node's memory, and the 2 survivors reshard the 3 shards. No replacement is launched.

From the script's own step ledger: every step done, at most one computed twice (at most K where the
cadence raised K on a loaded machine, as docs/elastic.md promises), the final weights those
of an uninterrupted single-process run (max |dw| <= 1e-9: the gradient averages over 3, 2 and 1 ranks
round differently in float64), and the resume after the kill came from the snapshots
(`snapshot.resume`), not from the periodic checkpoint up to 19 steps older, unless that checkpoint was newer
than a whole snapshot (K > 1 under load). The kill step and the
victim's rank are random; the seed is in every assertion message (PETCTL_TEST_SEED=<seed> repeats it).

The step is padded to 100 ms, the goal's step: a sharded snapshot costs this model's training thread
about 1 ms when the machine is loaded (0.3 to 0.6 ms when it is quiet), the cadence's limit for a
snapshot at every step on a 100 ms step; on a 50 ms step K then flaps between 1 and 2.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.support.cli import Petctl
from tests.support.snapshotloss import (
    Drill,
    check_memory_covered_the_loss,
    check_only_the_victims_snapshots_left,
    finished_ledger,
    run_and_kill_one,
    snapshot_root,  # noqa: F401 - a fixture
    steps_a_loss_may_cost,
)
from tests.support.userledger import USER_SCRIPT, replay

pytestmark = pytest.mark.slow

STEPS = 600  # padded until the survivors' first step, then unpadded (tests/support/snapshotloss.py: finish)
EVERY = 20
STEP_TIME = 0.1
GLOBAL_BATCH = 24  # splits over 3 ranks and over the 2 survivors
TOLERANCE = 1e-9


def script_args() -> tuple[str, ...]:
    return ("--fsdp", "--steps", str(STEPS), "--ckpt-every", str(EVERY), "--global-batch", str(GLOBAL_BATCH))


@pytest.mark.timeout(480)
def test_a_node_killed_at_a_random_step_costs_at_most_one_sharded_step(local: Petctl, tmp_path: Path,
                                                                       snapshot_root: Path) -> None:  # noqa: F811
    seed = int(os.environ.get("PETCTL_TEST_SEED") or random.randrange(1 << 30))
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    drill = Drill("shsnap", USER_SCRIPT, script_args(), STEPS, STEP_TIME)
    kill = run_and_kill_one(local, drill, ledger_dir, snapshot_root, seed)
    expected = replay(*script_args())
    ledger, story = finished_ledger(local, drill, tmp_path, ledger_dir, kill, expected, TOLERANCE)
    redone = ledger.redone()
    lines = local.events("shsnap", "snapshot.resume") + local.events("shsnap", "snapshot.fallback")
    resumes = [e for e in lines if e["ts"] > kill.at]
    assert resumes, story
    first = min(resumes, key=lambda e: e["ts"])
    stats = local.events("shsnap", "snapshot.stats")
    print(json.dumps({"why": kill.why, "event": first["event"], "resumed_step": first.get("step"),
                      "holders": first.get("holders"), "redone": sorted(redone),
                      "back_after_s": round(first["ts"] - kill.at, 2),
                      "every": sorted({s["every"] for s in stats}),
                      "blocked_ms": sorted(s["blocked_ms"] for s in stats), "rounds": ledger.story()}))
    k = steps_a_loss_may_cost(local, "shsnap", kill)  # 1 unless this machine's load raised the cadence
    assert len(redone) <= k, (f"{kill.why}: the loss cost more than K = {k} step(s): "
                              f"{ledger.describe_redone()}")
    source = "snapshot" if first["event"] == "snapshot.resume" else first["source"]
    assert source != "snapshot" or first["world"] == 3, (first, story)
    check_memory_covered_the_loss(local, "shsnap", kill, source, story)
    assert not local.events("shsnap", "snapshot.disabled"), story
    check_only_the_victims_snapshots_left(snapshot_root, kill.victim)
