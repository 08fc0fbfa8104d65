"""A scale-up of a running job whose workers take seconds to stop, end to end (CLI, local provider, agents).

Lightning installs a SIGTERM handler, so its workers take 1-2 s to exit. A node joining the running job
used to be the only one to have joined the next round while the old members were still stopping their
workers; after `last_call` it froze a round of its own (`round=2 rank=0 world_size=1`), the old members
came in one round later, and rank 0 had moved to the newcomer. The closer now waits for the previous
round's live members (petctl/agent/decisions.py), and they join before they stop their workers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import Petctl

pytestmark = pytest.mark.slow

SLOW_TO_STOP = '''\
"""A worker that takes 2 s to exit on SIGTERM, as Lightning's handler does; one step line every 0.1 s."""
import json, os, signal, sys, time

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def stop(*_):
    time.sleep(2.0)
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
step = 0
while True:
    print(json.dumps({"ts": time.time(), "event": "train.step", "step": step, "rank": RANK,
                      "world_size": WORLD}), flush=True)
    step += 1
    time.sleep(0.1)
'''


def formed(size: int):
    def check(status: dict[str, Any]) -> bool:
        if sorted(status["ranks"].values()) != list(range(size)):
            return False
        members = [status["nodes"].get(n, {}) for n in status["ranks"]]
        return all(m.get("state") == "running" and m.get("world_size") == size for m in members)
    return check


def stepping(cli: Petctl, job: str, nodes: set[str], world: int, since: float) -> bool:
    """Every node in `nodes` logged a step at world size `world` after `since`."""
    seen = {e["node"] for e in cli.events(job, "train.step") if e["ts"] > since and e["world_size"] == world}
    return nodes <= seen


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_scale_up_with_slow_stopping_workers_forms_one_round_and_keeps_ranks(local: Petctl, tmp_path: Path):
    script = tmp_path / "slow_to_stop.py"
    script.write_text(SLOW_TO_STOP)
    # last_call stays at its default (1 s, shorter than the workers' stop); stop_grace lets them finish.
    local.run("run_job", "--name", "slow", "--min", "1", "--max", "3", "--size", "2",
              "--timeout", "heartbeat_ttl=2",
              "--timeout", "stop_grace=5", "--wait", "--wait-timeout", "120", str(script))
    before = local.wait_status("slow", formed(2), 90, "a 2-node world")
    old = set(before["ranks"])
    # The workers' SIGTERM handler is in place once they print steps.
    wait_until(lambda: stepping(local, "slow", old, 2, 0), 60, "both old nodes stepping")

    t_scale = time.time()
    local.run("scale", "slow", "--size", "3")
    after = local.wait_status("slow", formed(3), 120, "a 3-node world after the scale-up")
    (newcomer,) = set(after["ranks"]) - old
    wait_until(lambda: stepping(local, "slow", old | {newcomer}, 3, t_scale), 60, "all three stepping")
    time.sleep(3)  # a second round, if one were coming, would have formed by now

    # Exactly one new round formed, with all three nodes in it.
    completes = [e for e in local.events("slow", "rendezvous.complete") if e["ts"] > t_scale]
    assert {e["round"] for e in completes} == {before["round_no"] + 1}, completes
    assert sorted(e["node"] for e in completes) == sorted(old | {newcomer})
    assert {e["world_size"] for e in completes} == {3}
    restarts = [e for e in local.events("slow", "rendezvous.restart") if e["ts"] > t_scale]
    assert [(e["round"], e["cause"]) for e in restarts] == [(before["round_no"] + 1, f"scale-up: {newcomer}")]
    # The old ranks are kept (rank 0 stays rank 0); the newcomer comes last.
    assert {n: after["ranks"][n] for n in old} == before["ranks"]
    assert after["ranks"][newcomer] == 2
    assert {e["rank"] for e in completes if e["node"] == newcomer} == {2}

    # The race the bug needed really happened: the newcomer had joined the new round while the old
    # members' workers were still handling SIGTERM (about 2 s).
    stopped = {e["node"]: e for e in local.events("slow", "workers.stopped") if e["ts"] > t_scale}
    assert set(stopped) == old and all(e["seconds"] >= 1.9 for e in stopped.values()), stopped
    (joined,) = [e for e in local.events("slow", "rendezvous.joined")
                 if e["node"] == newcomer and e["round"] == before["round_no"] + 1]
    assert joined["ts"] < min(e["ts"] for e in stopped.values())

    local.run("kill_job", "slow")
