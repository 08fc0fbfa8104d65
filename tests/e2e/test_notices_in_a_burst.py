"""Notices close together: the warm pool is refilled from the moment a round forms, not from its first
step, so a second notice early in a round is served by a warm worker. On this machine no node has a core to
spare, so it is the low-priority refill (`PETCTL_WARM_YIELD=1`) that runs.

Real etcd, real gloo workers (torch), the local metadata endpoint. The job's script spends 2 s in set-up
before its first step (data loading, a framework's set-up): a refill that waits for the first step (as it
did) starts at least that late, and the pool is empty for that long plus its imports.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.agent_harness import AgentCluster, AgentProc, make_spec, wait_for

pytestmark = pytest.mark.slow
SETUP_TIME = 2.0


@pytest.fixture
def cluster(etcd_server, tmp_path):
    spec = make_spec("burstrefill", etcd_server.endpoint, min_size=1, max_size=3, size=3,
                     script="elastic_steps.py", checkpoint_url=f"file://{tmp_path / 'ckpt'}",
                     env={"STEP_TIME": "0.05", "CKPT_EVERY": "1000", "SETUP_TIME": str(SETUP_TIME),
                          "PETCTL_WARM_YIELD": "1"},  # 2 shared cores here: no core to spare
                     imds_interval=0.5)
    c = AgentCluster(etcd_server.endpoint, tmp_path / "nodes", spec)
    yield c
    c.stop_all()


def notice(tmp_path: Path, node: AgentProc, grace: float = 60.0) -> None:
    notices = tmp_path / "notices"
    notices.mkdir(exist_ok=True)
    (notices / f"{node.node_id}.json").write_text(json.dumps({"kind": "spot", "time": time.time() + grace}))


def started_in(node: AgentProc, round_no: int) -> list[dict]:
    return wait_for(lambda: [e for e in node.events("workers.started") if e["round"] == round_no], 30,
                    what=f"{node.node_id}'s workers of round {round_no}")


def one(events: list[dict], what: str) -> dict:
    assert len(events) == 1, (what, events)
    return events[0]


def test_a_second_notice_early_in_a_round_finds_a_warm_worker(cluster, metadata_server, tmp_path):
    nodes = [cluster.start(imds=metadata_server.endpoint_for) for _ in range(3)]
    st = wait_for(lambda: (s := cluster.state()).world_size == 3 and s, 60, what="world of 3")
    wait_for(lambda: all(len(cluster.steps(n.node_id)) >= 5 for n in nodes), 40, what="training")
    # The first notice, once every pool is warm again (a job that ran a while).
    wait_for(lambda: all([e for e in n.events("workers.warm_ready") if e.get("round") == st.round.round]
                         for n in nodes), 60, what="warm pools refilled")
    first = next(n for n in nodes if st.ranks[n.node_id] == 2)
    notice(tmp_path, first)
    st2 = wait_for(lambda: (s := cluster.state()).world_size == 2 and s, 40, what="world of 2")
    survivors = [n for n in nodes if n is not first]
    r2 = st2.round.round
    for node in survivors:
        started = one(started_in(node, r2), "round 2's workers")
        assert (started["warm"], started["warm_ready"]) == (1, 1)
        ready = wait_for(lambda n=node: [e for e in n.events("workers.warm_ready") if e.get("round") == r2],
                         60, what="round 2's refill ready")[0]
        refill_started = ready["ts"] - ready["seconds"]
        # The refill began when the round formed, not at its first step (SETUP_TIME later).
        assert refill_started - started["ts"] < 1.0, (started, ready)
        at_two = wait_for(lambda n=node: [s for s in cluster.steps(n.node_id) if s["world_size"] == 2], 30,
                          what="steps at world 2")
        first_step = min(s["ts"] for s in at_two)
        assert refill_started < first_step - SETUP_TIME / 2, (refill_started, first_step)
    # The second notice, as soon as the pool is warm: early in round 2 (its refill's imports, a few s).
    second = next(n for n in survivors if st2.ranks[n.node_id] == 1)
    last = next(n for n in survivors if n is not second)
    # By now rank 0 has measured a save (the first hand-off's), so a spot-noticed node trains on until the
    # last moment that leaves time for its save (agent/roundjudge.py, `handoff`): a short notice keeps
    # that moment, and so the re-form, early in round 2.
    notice(tmp_path, second, grace=8.0)
    st3 = wait_for(lambda: (s := cluster.state()).world_size == 1 and s, 40, what="world of 1")
    started3 = one(started_in(last, st3.round.round), "round 3's workers")
    assert (started3["warm"], started3["warm_ready"]) == (1, 1)  # a warm worker, imports done
    wait_for(lambda: any(s["world_size"] == 1 for s in cluster.steps(last.node_id)), 30, what="world 1")
    # The ledger: each round resumes right after the last step of the one before; nothing redone.
    steps = cluster.steps(last.node_id)
    by_world = {w: [s["step"] for s in steps if s["world_size"] == w] for w in (3, 2, 1)}
    assert by_world[2][0] == max(by_world[3]) + 1 and by_world[1][0] == max(by_world[2]) + 1, by_world
    assert [s["step"] for s in steps] == list(range(len(steps))), "a step redone or lost"
    for node in (first, second):
        assert node.events("agent.left")[0]["cause"] == "preemption"
