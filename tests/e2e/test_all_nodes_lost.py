"""Fault matrix, issue 13 item 3: every node lost at once (a power cut, an AZ gone), then capacity back
within `join_timeout`. Nothing of the job's training state survives on any node: the job resumes from
the store, from the newest checkpoint that was complete when the nodes died, and finishes with the
exact weights. `--min 3`: the job has fewer than `min` nodes from the blackout until all three
replacements are up, which is what `join_timeout` bounds (a smaller min would let the first two
replacements train alone and restart when the third arrives, which tests/e2e/test_local_jobs.py covers).

Real etcd, agents and gloo workers on the local provider; the local reconciler plays the Auto Scaling
group that brings the capacity back (after `--replace-delay`).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from petctl.io.procs import ProcRef
from petctl.providers.local.jobdir import JobDir
from tests.support.cli import Petctl
from tests.support.ledger import Ledger, manifests
from tests.support.matrix import final_rounds, ledger_steps, run_ledger_job, wait_until

pytestmark = pytest.mark.slow

STEPS, EVERY, JOIN_TIMEOUT = 70, 10, 60


def kill_every_instance(job: JobDir) -> list[str]:
    """SIGKILL every instance's process group at once, each marked as chaos (as `petctl chaos --kill`)."""
    rows = [r for r in job.read_instances() if r.get("state") == "running"]
    for row in rows:
        job.chaos_marker(row["id"]).write_text("kill\n")
    for row in rows:
        ProcRef(int(row["pid"]), row.get("start")).signal_group(signal.SIGKILL)
    return [r["id"] for r in rows]


@pytest.mark.timeout(240)
def test_every_node_lost_at_once_resumes_from_the_store(local: Petctl, tmp_path: Path):
    ledger_dir = tmp_path / "ledger"
    run_ledger_job(local, ledger_dir, "blackout", "--min", "3", "--max", "3", "--size", "3",
                   "--replace-delay", "2", "--timeout", f"join_timeout={JOIN_TIMEOUT}", "--wait",
                   "--wait-timeout", "120", STEPS=STEPS, CKPT_EVERY=EVERY, STEP_TIME=0.03)
    job = JobDir(local.job_dir("blackout"))
    checkpoints = job.checkpoints
    # Training at world 3, with at least two checkpoints in the store.
    wait_until(lambda: len(manifests(checkpoints)) >= 2 and ledger_steps(ledger_dir, 3) >= 3 * 2 * EVERY, 90,
               "two checkpoints at world size 3")

    old = set(kill_every_instance(job))
    t_kill = time.time()
    assert len(old) == 3
    newest = max(manifests(checkpoints))  # nothing can add one now: every writer is dead
    time.sleep(0.5)
    assert manifests(checkpoints)[-1] == newest

    info = local.wait_finished("blackout", timeout=150)
    assert info["state"] == "succeeded", info

    ledger = Ledger.read(ledger_dir)
    ledger.assert_exact(STEPS, ledger_dir / "final.json")  # every step's weights, and the final ones
    runs = ledger.training_rounds()
    before = [r for r in runs if set(r.ranks) <= old]
    after = [r for r in runs if not set(r.ranks) & old]
    assert before and after and len(before) + len(after) == len(runs), [(r.round, r.ranks) for r in runs]
    # The first round after the blackout: three new nodes, ranks 0..2, resumed from the newest complete
    # checkpoint (the store's), and every step from there to the end ran exactly once more.
    first = after[0]
    assert len(first.ranks) == 3 and sorted(first.ranks.values()) == [0, 1, 2] and first.worlds == {3}
    assert first.loaded == {newest} and first.first == newest + 1, (first.loaded, newest)
    last_before = max(max(s) for s in before[-1].steps.values())
    assert 0 <= last_before - newest <= 2 * EVERY  # lost: the steps since the newest checkpoint, no more
    assert ledger.redone()[len(before) - 1] == last_before - newest
    assert max(s[-1] for s in after[-1].steps.values()) == STEPS - 1

    # The agents agree: one round for the three newcomers, formed after the blackout, since the old
    # members were all lost; the job never waited near join_timeout for them.
    rounds = final_rounds(local, "blackout")
    new = {n: e for n, e in rounds.items() if n not in old}
    assert len(new) == 3 and len({e["round"] for e in new.values()}) == 1
    assert sorted(e["rank"] for e in new.values()) == [0, 1, 2]
    assert {e["world_size"] for e in new.values()} == {3}
    formed = min(e["ts"] for e in new.values())
    assert formed - t_kill < JOIN_TIMEOUT / 2, formed - t_kill
    restarts = [e for e in local.events("blackout", "rendezvous.restart") if e["ts"] > t_kill]
    assert "all members of the previous round lost" in {e["cause"] for e in restarts}, restarts
    assert all(not e["failure"] for e in restarts)  # a lost node is not a worker failure
    hosts = {h["host_id"]: h["state"] for h in local.json("hosts", "blackout", "--all")}
    assert all(hosts[n] == "terminated" for n in old)
    assert len(local.processes()) == 1  # etcd only
