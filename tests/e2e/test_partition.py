"""Fault matrix item 1: a network partition of one node, end to end.

Three real agents (tests/support/agent_harness.py, no provider) against a real etcd, real gloo workers
training tests/workloads/ledger_steps.py with checkpoints in a shared directory. One node runs in its own
network namespace (tests/support/netns.py): its agent and workers reach etcd and the other two nodes only
through a veth link, and the cut is `ip link set <veth> down`. The namespaced node starts first, so it is
rank 0: the checkpoint writer, the one whose fencing matters.

Asserted from what the processes wrote: the step ledger (rank 0's `train.step` / `train.resumed` lines
and the `checkpoint.saved` events), the final weights against the same steps applied once each in this
process, the rank sets in etcd, the detection time (`membership.lost` minus the cut), the manifests in
the store (who wrote each, when), and the partitioned agent's own events.

The sanity variant never cuts the link: it proves the namespaces, the addresses and gloo's interfaces
work, and, with a fence file written by hand midway on rank 0's node, that real workers commit no
checkpoint while it exists (training goes on) and commit again once it is removed. The cut variant needs
the agent's fencing (petctl/agent/health.py); until that exists, the assertions about the partitioned
node are an expected failure, and only those.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from petctl.io import controlfiles
from tests.support.agent_harness import AgentCluster, AgentProc, dump, make_spec, wait_for, wait_ready
from tests.support.netns import NetLab, Slot, netns_available
from tests.support.partition_checks import CKPT_EVERY, STEPS, Outcome, workload_env

pytestmark = pytest.mark.slow
_names = itertools.count()

TTL = 2.0
DETECTION_MARGIN = 4.0  # heartbeat interval + the judge's poll + a loaded 2-core machine


@dataclass
class PartitionJob:
    lab: NetLab
    cluster: AgentCluster
    outcome: Outcome

    @property
    def slot(self) -> Slot:  # the one namespaced node's place on the lab
        return self.lab.slots[0]

    def start_namespaced(self) -> AgentProc:
        """The node that can be cut off: inside the namespace, gloo on its end of the veth."""
        return self.cluster.start(prefix=self.slot.prefix(), host_addr=self.slot.addr,
                                  env={"GLOO_SOCKET_IFNAME": self.slot.ns_if})

    def start_host(self) -> AgentProc:
        """A node in the root namespace: peers reach it on the bridge's address, gloo binds the bridge."""
        return self.cluster.start(host_addr=self.lab.host_addr, env={"GLOO_SOCKET_IFNAME": self.lab.bridge})

    def start_three(self) -> tuple[AgentProc, AgentProc, AgentProc]:
        """The namespaced node first (it joins first, so it is rank 0), then two in the root namespace."""
        ns_node = self.start_namespaced()
        wait_ready([ns_node])
        wait_for(lambda: ns_node.events("rendezvous.joined"), 30, what="the namespaced node's join")
        return ns_node, self.start_host(), self.start_host()

    def events(self, name: str) -> list[dict[str, Any]]:
        """`name` events of every node, each tagged with its node, oldest first."""
        out = [{**e, "node": e.get("node") or a.node_id} for a in self.cluster.agents.values()
               for e in a.events(name)]
        return sorted(out, key=lambda e: e["ts"])


@pytest.fixture
def job(tmp_path: Path) -> Iterator[PartitionJob]:
    if reason := netns_available():
        pytest.skip(reason)
    lab = NetLab(tmp_path)
    cluster: AgentCluster | None = None
    try:
        lab.build()
        endpoint = lab.start_etcd(tmp_path / "etcd")
        ckpt, results = tmp_path / "ckpt", tmp_path / "results"
        results.mkdir()
        spec = make_spec(f"part{next(_names)}", endpoint, min_size=2, max_size=3, size=3,
                         script="ledger_steps.py", checkpoint_url=ckpt.as_uri(), max_restarts=5,
                         env=workload_env(results), heartbeat_ttl=TTL)
        # join_timeout stays the product's default. The namespaced node joins alone first and waits while
        # the other two import torch for their warm workers before registering, at the machine's speed:
        # 19-20 s beside a second e2e pass, where a 20 s join_timeout ended the job "fewer than min=2
        # nodes for 20s", as configured. No case here waits on it: a cut-off node cannot reach etcd.
        cluster = AgentCluster(endpoint, tmp_path / "nodes", spec)
        pj = PartitionJob(lab, cluster, Outcome(ckpt, results, lambda name: pj.events(name)))
        yield pj
    finally:
        if cluster is not None:
            cluster.stop_all()
        problems = lab.close()
        assert not problems, f"lab cleanup left: {problems}"


@pytest.mark.timeout(300)
def test_sanity_three_nodes_one_namespaced_train_to_exact_weights(job: PartitionJob) -> None:
    """No cut: the namespaced node is rank 0 and the master; the others reach it over the veth."""
    ns_node, a, b = job.start_three()
    wait_ready([a, b])  # their imports, at the machine's speed; then the join, at the product's
    st = wait_for(lambda: (s := job.cluster.state()).world_size == 3 and s, 30, what="a world of 3")
    assert st.ranks[ns_node.node_id] == 0 and {st.ranks[a.node_id], st.ranks[b.node_id]} == {1, 2}
    # Midway, a fence as the agent writes it on rank 0's node: commits stop (training does not), and
    # start again once it is lifted.
    wait_for(lambda: len(ns_node.events("checkpoint.saved")) >= 3, 90, what="3 checkpoints")
    control = job.cluster.root / ns_node.node_id / "control"
    controlfiles.write_fence(control, round_no=1, reason="test: a fence mid-run")
    (fenced,) = wait_for(lambda: ns_node.events("checkpoint.fenced"), 30, what="checkpoint.fenced")
    later = fenced["step"] + 2 * CKPT_EVERY
    wait_for(lambda: [e for e in ns_node.events("train.step") if e["step"] >= later], 30,
             what="two more saves due under the fence")
    controlfiles.fence_path(control).unlink()
    for agent in (ns_node, a, b):
        assert agent.proc.wait(timeout=180) == 0, agent.log.read_text()[-3000:]
    final = job.cluster.state()
    assert final.result is not None and final.result.state == "succeeded", dump(final.to_dict())
    lineage, resumes = job.outcome.final_lineage()
    assert lineage == list(range(STEPS))
    assert [r["step"] for r in resumes] == [0]
    for agent in (ns_node, a, b):  # every node ran every step, in one world of 3
        steps = agent.events("train.step")
        assert [s["step"] for s in steps] == list(range(STEPS))
        assert {s["world_size"] for s in steps} == {3}
    assert job.outcome.assert_exact_weights() == ns_node.node_id
    manifests = job.outcome.manifests()
    assert {m.meta["node_id"] for m in manifests} == {ns_node.node_id}
    due = list(range(CKPT_EVERY - 1, STEPS, CKPT_EVERY))
    missing = sorted(set(due) - {m.step for m in manifests})
    (unfenced,) = ns_node.events("checkpoint.unfenced")
    assert len(missing) == unfenced["skipped"] >= 2 and missing[0] == fenced["step"]
    assert missing == due[due.index(missing[0]):due.index(missing[0]) + len(missing)]  # one run of saves
    assert unfenced["step"] == missing[-1] + CKPT_EVERY  # the first save after the lift commits


@pytest.mark.timeout(420)
def test_partitioned_node_is_dropped_and_fences_itself(job: PartitionJob) -> None:
    ns_node, a, b = job.start_three()
    wait_ready([a, b])  # their imports, at the machine's speed; then the join, at the product's
    st = wait_for(lambda: (s := job.cluster.state()).world_size == 3 and s, 30, what="a world of 3")
    assert st.ranks[ns_node.node_id] == 0
    a, b = sorted((a, b), key=lambda n: st.ranks[n.node_id])  # a: rank 1, b: rank 2
    # Cut once a few checkpoints are committed, in the middle of the job.
    wait_for(lambda: len(ns_node.events("checkpoint.saved")) >= 4, 90, what="4 checkpoints")
    t_cut = time.time()
    job.lab.cut(job.slot)

    # The connected pair re-forms without the cut-off node, within the detection time, and finishes.
    lost = wait_for(lambda: job.outcome.lost_events(ns_node.node_id, t_cut), 30,
                    what="membership.lost of the cut node")
    t_lost = min(e["ts"] for e in lost)
    assert t_lost - t_cut <= TTL + DETECTION_MARGIN, f"detected after {t_lost - t_cut:.1f}s"
    st = wait_for(lambda: (s := job.cluster.state()).world_size == 2 and s, 30, what="a world of 2")
    assert st.ranks == {a.node_id: 0, b.node_id: 1}  # old members keep their order; rank 0 moves to a
    for agent in (a, b):
        assert agent.proc.wait(timeout=180) == 0, agent.log.read_text()[-3000:]
    final = job.cluster.state()
    assert final.result is not None and final.result.state == "succeeded", dump(final.to_dict())

    # The ledger: the pair resumed from the newest committed checkpoint; no step twice in the lineage.
    lineage, resumes = job.outcome.final_lineage()
    assert lineage == list(range(STEPS))
    (resumed,) = [r for r in resumes if r["ts"] > t_cut]
    assert resumed["node"] == a.node_id and resumed["world_size"] == 2 and 0 < resumed["step"] < STEPS
    assert job.outcome.assert_exact_weights() == a.node_id
    job.outcome.measure(job.outcome.results.parent / "measured.json", t_cut, t_lost - t_cut, resumed)
    job.outcome.assert_survivors_own_the_store(ns_node.node_id, {a.node_id, b.node_id}, t_lost)

    # The cut-off agent fenced itself: the fence event, its workers stopped, no crash.
    fenced = wait_for(lambda: ns_node.events("agent.fenced"), 30, what="agent.fenced on the cut node")
    assert fenced[0]["ts"] > t_cut
    assert ns_node.events("agent.crashed") == []
    wait_for(lambda: [e for e in ns_node.events("workers.stopped") if e["ts"] > t_cut], 30,
             what="the cut node's workers stopped")
    assert not any(e["ts"] > fenced[0]["ts"] for e in ns_node.events("train.step"))

    # The link comes back: the job is over, so its agent ends (no crash), and it never wrote.
    job.lab.heal(job.slot)
    assert ns_node.proc.wait(timeout=60) in (0, 1), ns_node.log.read_text()[-3000:]
    assert ns_node.events("agent.crashed") == []
    assert job.outcome.manifests_by(ns_node.node_id, t_lost) == []
