"""An announced preemption end to end: local metadata endpoint -> agent -> petctl.elastic -> restart.

Real etcd, real gloo workers, the real IMDSv2 paths served locally, checkpoints in a file:// store.
The claim under test is the product's: an announced preemption loses no step.
"""

from __future__ import annotations

import itertools
import json
import signal
import time

import pytest

from tests.support.agent_harness import AgentCluster, make_spec, wait_for

pytestmark = pytest.mark.slow
_names = itertools.count()


@pytest.fixture
def cluster(etcd_server, tmp_path):
    spec = make_spec(f"pre{next(_names)}", etcd_server.endpoint, min_size=1, max_size=3, size=3,
                     script="elastic_steps.py", checkpoint_url=f"file://{tmp_path / 'ckpt'}",
                     env={"STEP_TIME": "0.1", "CKPT_EVERY": "1000"}, imds_interval=0.5)
    c = AgentCluster(etcd_server.endpoint, tmp_path / "nodes", spec)
    yield c
    c.stop_all()


def round_steps(cluster: AgentCluster, node_id: str) -> list[dict]:
    return cluster.steps(node_id)


def test_announced_preemption_loses_no_step(cluster, metadata_server, tmp_path):
    nodes = [cluster.start(imds=metadata_server.endpoint_for) for _ in range(3)]
    st = wait_for(lambda: (s := cluster.state()).world_size == 3 and s, 40, what="world of 3")
    wait_for(lambda: all(len(cluster.steps(n.node_id)) >= 5 for n in nodes), 30, what="training")
    victim = next(n for n in nodes if st.ranks[n.node_id] == 1)
    survivors = [n for n in nodes if n is not victim]
    notices = tmp_path / "notices"
    notices.mkdir(exist_ok=True)
    t_notice = time.time()
    (notices / f"{victim.node_id}.json").write_text(json.dumps({"kind": "spot", "time": t_notice + 20}))

    st2 = wait_for(lambda: (s := cluster.state()).world_size == 2 and s, 40, what="world of 2")
    # No replacement comes (this harness has no group), and no save was measured before the notice (no
    # periodic save yet): nothing says the window is long enough, so the node handed off at once.
    (handoff,) = victim.events("preemption.handoff")
    assert handoff["why"] == "deadline" and handoff["ts"] < t_notice + 5
    assert victim.node_id not in st2.ranks
    assert st2.round.restarts == 0
    for node in survivors:
        steps = cluster.steps(node.node_id)
        wait_for(lambda n=node: any(s["world_size"] == 2 for s in cluster.steps(n.node_id)), 30,
                 what="steps at world 2")
        steps = cluster.steps(node.node_id)
        before = [s["step"] for s in steps if s["world_size"] == 3]
        after = [s["step"] for s in steps if s["world_size"] == 2]
        # The checkpoint holds the last step run at world 3; the new round starts right after it.
        assert after[0] == max(before) + 1, (max(before), after[:3])
        assert max(before) >= 4  # it had trained (steps 0..4 at least) when the notice came
    # Every rank of the old round saved the same step, and the noticed node left gracefully.
    resumed = [e for n in survivors for e in n.events("train.resumed") if e["ts"] > t_notice]
    assert {e["step"] for e in resumed} == {max(before) + 1}
    assert victim.events("agent.left") and victim.events("agent.left")[0]["cause"] == "preemption"
    assert victim.events("preemption.notice")[0]["kind"] == "spot"
    victim.signal_group(signal.SIGKILL)  # the instance is reclaimed at the notice's time


def test_kill_without_notice_resumes_from_last_periodic_checkpoint(cluster, metadata_server):
    """The store path: with the in-memory snapshots off, a loss without notice resumes right after the
    newest periodic save. (With them on, the survivors resume from their snapshot of the last step:
    tests/e2e/test_node_loss.py; here the kill's step against the save cadence decided which.)"""
    cluster.spec.env["CKPT_EVERY"] = "5"
    cluster.spec.env["PETCTL_SNAPSHOTS"] = "0"
    nodes = [cluster.start(imds=metadata_server.endpoint_for) for _ in range(3)]
    st = wait_for(lambda: (s := cluster.state()).world_size == 3 and s, 40, what="world of 3")
    wait_for(lambda: all(len(cluster.steps(n.node_id)) >= 8 for n in nodes), 30, what="training")
    victim = next(n for n in nodes if st.ranks[n.node_id] == 2)
    survivor = next(n for n in nodes if st.ranks[n.node_id] == 0)
    victim.signal_group(signal.SIGKILL)
    wait_for(lambda: any(s["world_size"] == 2 for s in cluster.steps(survivor.node_id)), 40,
             what="steps at world 2")
    steps = cluster.steps(survivor.node_id)
    before = [s["step"] for s in steps if s["world_size"] == 3]
    first_after = next(s["step"] for s in steps if s["world_size"] == 2)
    # Periodic saves happen at steps 4, 9, 14, ... (every 5): resume right after the newest one.
    newest_saved = max(s for s in before if (s + 1) % 5 == 0)
    assert first_after == newest_saved + 1, (before[-3:], first_after)
    assert first_after <= max(before) + 1


def test_a_plain_script_stopped_at_a_notice_is_not_said_to_have_saved(etcd_server, metadata_server, tmp_path):
    """A script without petctl.elastic (tests/workloads/steps.py) gets SIGTERM at the notice and reports
    no save: the noticed node's round ends saying so, not "preemption checkpoint done" (issue 15)."""
    spec = make_spec(f"plain{next(_names)}", etcd_server.endpoint, min_size=1, max_size=2, size=2,
                     env={"STEP_TIME": "0.1"}, imds_interval=0.5)
    cluster = AgentCluster(etcd_server.endpoint, tmp_path / "nodes", spec)
    try:
        nodes = [cluster.start(imds=metadata_server.endpoint_for) for _ in range(2)]
        st = wait_for(lambda: (s := cluster.state()).world_size == 2 and s, 40, what="world of 2")
        wait_for(lambda: all(len(cluster.steps(n.node_id)) >= 3 for n in nodes), 30, what="training")
        victim = next(n for n in nodes if st.ranks[n.node_id] == 1)
        notices = tmp_path / "notices"
        notices.mkdir(exist_ok=True)
        notice = {"kind": "spot", "time": time.time() + 60}
        (notices / f"{victim.node_id}.json").write_text(json.dumps(notice))
        wait_for(lambda: victim.events("agent.left"), 40, what="the noticed node leaving")
        assert victim.events("agent.left")[0]["cause"] == "preemption"
        (summary,) = [e for e in victim.events("round.summary") if e["round"] == st.round.round]
        (stopped,) = [e for e in victim.events("workers.stopped") if e["round"] == st.round.round]
        assert summary["why"] == stopped["why"] == "preempted: workers stopped by SIGTERM, no save reported"
    finally:
        cluster.stop_all()
