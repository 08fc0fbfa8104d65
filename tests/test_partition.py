"""Fault matrix item 1: a network partition of one node, end to end.

Three real agents (tests/agent_harness.py, no provider) against a real etcd, real gloo workers training
tests/workloads/ledger_steps.py with checkpoints in a shared directory. One node runs in its own network
namespace (tests/netns.py): its agent and workers reach etcd and the other two nodes only through a veth
link, and the cut is `ip link set <veth> down`. The namespaced node starts first, so it is rank 0: the
checkpoint writer, the one whose fencing matters.

Asserted from what the processes wrote: the step ledger (rank 0's `train.step` / `train.resumed` lines
and the `checkpoint.saved` events), the final weights against the same steps applied once each in this
process, the rank sets in etcd, the detection time (`membership.lost` minus the cut), the manifests in
the store (who wrote each, when), and the partitioned agent's own events.

The sanity variant never cuts the link: it proves the namespaces, the addresses and gloo's interfaces
work. The cut variant needs the agent's fencing (petctl/agent/fencing.py); until that exists, the
assertions about the partitioned node are an expected failure, and only those.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from petctl.elastic import manifest as mf
from petctl.elastic.store import open_store
from tests.agent_harness import WORKLOADS, AgentCluster, AgentProc, dump, make_spec, wait_for
from tests.netns import NetLab, netns_available

_NETNS = netns_available() if os.geteuid() == 0 else "needs root (network namespaces)"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_NETNS), reason=_NETNS or "ok")]
_names = itertools.count()

STEPS = 150
CKPT_EVERY = 5
TTL = 2.0
DETECTION_MARGIN = 4.0  # heartbeat interval + the judge's poll + a loaded 2-core machine
FENCING = importlib.util.find_spec("petctl.agent.fencing") is not None


def reference_weights(steps: int) -> list[list[float]]:
    """The workload's own reference: the same steps applied once each, in this process."""
    spec = importlib.util.spec_from_file_location("ledger_steps", WORKLOADS / "ledger_steps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_weights(steps)


@dataclass
class PartitionJob:
    lab: NetLab
    cluster: AgentCluster
    ckpt_dir: Path
    results: Path

    def start_namespaced(self) -> AgentProc:
        """The node that can be cut off: inside the namespace, gloo on its end of the veth."""
        return self.cluster.start(prefix=self.lab.ns_prefix(), host_addr=self.lab.ns_addr,
                                  env={"GLOO_SOCKET_IFNAME": self.lab.ns_if})

    def start_host(self) -> AgentProc:
        """A node in the root namespace: peers reach it on the bridge's address, gloo binds the bridge."""
        return self.cluster.start(host_addr=self.lab.host_addr, env={"GLOO_SOCKET_IFNAME": self.lab.bridge})

    def start_three(self) -> tuple[AgentProc, AgentProc, AgentProc]:
        """The namespaced node first (it joins first, so it is rank 0), then two in the root namespace."""
        ns_node = self.start_namespaced()
        wait_for(lambda: ns_node.events("rendezvous.joined"), 30, what="the namespaced node's join")
        return ns_node, self.start_host(), self.start_host()

    def events(self, name: str) -> list[dict[str, Any]]:
        """`name` events of every node, each tagged with its node, oldest first."""
        out = [{**e, "node": e.get("node") or a.node_id} for a in self.cluster.agents.values()
               for e in a.events(name)]
        return sorted(out, key=lambda e: e["ts"])

    def weights(self) -> dict[str, Any]:
        files = sorted(self.results.glob("weights-*.json"))
        assert len(files) == 1, f"expected the final round's rank 0 alone to write weights: {files}"
        return {"node": files[0].stem.removeprefix("weights-"), **json.loads(files[0].read_text())}

    def manifests(self) -> list[mf.Manifest]:
        store = open_store(self.ckpt_dir.as_uri())
        return [mf.read_manifest(store, step) for step in mf.manifest_steps(store)]


@pytest.fixture
def job(tmp_path: Path) -> Iterator[PartitionJob]:
    lab = NetLab(tmp_path)
    cluster: AgentCluster | None = None
    try:
        lab.build()
        endpoint = lab.start_etcd(tmp_path / "etcd")
        ckpt, results = tmp_path / "ckpt", tmp_path / "results"
        results.mkdir()
        spec = make_spec(f"part{next(_names)}", endpoint, min_size=2, max_size=3, size=3,
                         script="ledger_steps.py", checkpoint_url=ckpt.as_uri(), max_restarts=5,
                         env={"STEPS": str(STEPS), "STEP_TIME": "0.08", "CKPT_EVERY": str(CKPT_EVERY),
                              "RESULT_DIR": str(results)},
                         heartbeat_ttl=TTL, join_timeout=20.0)
        cluster = AgentCluster(endpoint, tmp_path / "nodes", spec)
        yield PartitionJob(lab, cluster, ckpt, results)
    finally:
        if cluster is not None:
            cluster.stop_all()
        problems = lab.close()
        assert not problems, f"lab cleanup left: {problems}"


def rank0_ledger(job: PartitionJob) -> list[dict[str, Any]]:
    """Rank 0's step and resume lines, every node and round, in time order."""
    return [e for e in job.events("train.step") + job.events("train.resumed") if e["rank"] == 0]


def final_lineage(job: PartitionJob) -> tuple[list[int], list[dict[str, Any]]]:
    """Replay rank 0's ledger: a resume at step r keeps the lineage's steps < r (what the checkpoint of
    r - 1 holds) and drops the rest; each step appends. Every resume must load the newest checkpoint
    committed before it. Returns (the steps behind the final weights, the resumes)."""
    saved = job.events("checkpoint.saved")
    lineage: list[int] = []
    resumes = []
    for e in sorted(rank0_ledger(job), key=lambda e: e["ts"]):
        if e["event"] == "train.step":
            lineage.append(e["step"])
            continue
        committed = [s["step"] for s in saved if s["ts"] < e["ts"]]
        assert e["step"] == (max(committed) + 1 if committed else 0), (
            f"resumed at {e['step']}, the newest checkpoint committed before was {committed[-1:]}")
        assert lineage[:e["step"]] == list(range(e["step"])), "resumed past steps never applied"
        del lineage[e["step"]:]
        resumes.append(e)
    return lineage, resumes


def late_manifests(job: PartitionJob, node: AgentProc, since: float) -> list[int]:
    """Steps of the checkpoints `node` committed at or after `since`."""
    return [m.step for m in job.manifests() if m.meta["node_id"] == node.node_id and m.created >= since]


def data_written_since(job: PartitionJob, since: float) -> set[int]:
    """Steps whose data objects (committed or not) were written at or after `since` (file mtimes)."""
    return {int(m.group(1)) for path in job.ckpt_dir.rglob("*") if path.is_file()
            and path.stat().st_mtime >= since and (m := mf.DATA_RE.match(f"{path.parent.name}/"))}


def assert_exact_weights(job: PartitionJob) -> dict[str, Any]:
    final = job.weights()
    assert final["weights"] == reference_weights(STEPS), "final weights differ from STEPS steps applied once"
    return final


@pytest.mark.timeout(300)
def test_sanity_three_nodes_one_namespaced_train_to_exact_weights(job: PartitionJob) -> None:
    """No cut: the namespaced node is rank 0 and the master; the others reach it over the veth."""
    ns_node, a, b = job.start_three()
    st = wait_for(lambda: (s := job.cluster.state()).world_size == 3 and s, 60, what="a world of 3")
    assert st.ranks[ns_node.node_id] == 0 and {st.ranks[a.node_id], st.ranks[b.node_id]} == {1, 2}
    for agent in (ns_node, a, b):
        assert agent.proc.wait(timeout=180) == 0, agent.log.read_text()[-3000:]
    final = job.cluster.state()
    assert final.result is not None and final.result.state == "succeeded", dump(final.to_dict())
    lineage, resumes = final_lineage(job)
    assert lineage == list(range(STEPS))
    assert [r["step"] for r in resumes] == [0]
    for agent in (ns_node, a, b):  # every node ran every step, in one world of 3
        steps = agent.events("train.step")
        assert [s["step"] for s in steps] == list(range(STEPS))
        assert {s["world_size"] for s in steps} == {3}
    assert assert_exact_weights(job)["node"] == ns_node.node_id
    manifests = job.manifests()
    assert [m.step for m in manifests] == list(range(STEPS - 1, -1, -CKPT_EVERY))
    assert {m.meta["node_id"] for m in manifests} == {ns_node.node_id}


@pytest.mark.timeout(420)
def test_partitioned_node_is_dropped_and_fences_itself(job: PartitionJob) -> None:
    ns_node, a, b = job.start_three()
    st = wait_for(lambda: (s := job.cluster.state()).world_size == 3 and s, 60, what="a world of 3")
    assert st.ranks[ns_node.node_id] == 0
    a, b = sorted((a, b), key=lambda n: st.ranks[n.node_id])  # a: rank 1, b: rank 2
    # Cut once a few checkpoints are committed, in the middle of the job.
    wait_for(lambda: len([e for e in ns_node.events("checkpoint.saved")]) >= 4, 90, what="4 checkpoints")
    t_cut = time.time()
    job.lab.cut()

    # The connected pair re-forms without the cut-off node, within the detection time, and finishes.
    lost = wait_for(lambda: [e for e in job.events("membership.lost") if e["ts"] > t_cut
                             and ns_node.node_id in e["nodes"]], 30, what="membership.lost of the cut node")
    detection = min(e["ts"] for e in lost) - t_cut
    assert detection <= TTL + DETECTION_MARGIN, f"detected after {detection:.1f}s"
    st = wait_for(lambda: (s := job.cluster.state()).world_size == 2 and s, 30, what="a world of 2")
    assert st.ranks == {a.node_id: 0, b.node_id: 1}  # old members keep their order; rank 0 moves to a
    for agent in (a, b):
        assert agent.proc.wait(timeout=180) == 0, agent.log.read_text()[-3000:]
    final = job.cluster.state()
    assert final.result is not None and final.result.state == "succeeded", dump(final.to_dict())

    # The ledger: the pair resumed from the newest committed checkpoint; no step twice in the lineage.
    lineage, resumes = final_lineage(job)
    assert lineage == list(range(STEPS))
    (resumed,) = [r for r in resumes if r["ts"] > t_cut]
    assert resumed["node"] == a.node_id and resumed["world_size"] == 2 and 0 < resumed["step"] < STEPS
    assert assert_exact_weights(job)["node"] == a.node_id
    before_cut = [e["step"] for e in rank0_ledger(job) if e["event"] == "train.step" and e["ts"] < t_cut]
    (job.results.parent / "measured.json").write_text(json.dumps({  # for the record, read by nobody here
        "detection_s": round(detection, 3), "resumed_at": resumed["step"],
        "steps_redone": max(before_cut) + 1 - resumed["step"],
        "resumed_after_cut_s": round(resumed["ts"] - t_cut, 3)}))

    # Nothing the cut-off node wrote became visible after it was dropped.
    t_lost = min(e["ts"] for e in lost)
    late = late_manifests(job, ns_node, t_lost)
    assert late == [], f"the partitioned node committed checkpoints {late} after it was dropped"
    assert [e["step"] for e in ns_node.events("checkpoint.saved") if e["ts"] >= t_lost] == []
    survivors_steps = {m.step for m in job.manifests() if m.meta["node_id"] in (a.node_id, b.node_id)}
    written_late = data_written_since(job, t_lost)
    assert written_late, "the survivors' own checkpoints should show up as written after the drop"
    assert written_late <= survivors_steps, f"data of steps {sorted(written_late - survivors_steps)} " \
        "written after the drop by someone other than the survivors"

    if not FENCING:
        pytest.xfail("needs the agent's fencing (lead): petctl/agent/fencing.py is not there yet")
    # The cut-off agent fenced itself: the fence event, its workers stopped, no crash.
    fenced = wait_for(lambda: ns_node.events("agent.fenced"), 30, what="agent.fenced on the cut node")
    assert fenced[0]["ts"] > t_cut
    assert ns_node.events("agent.crashed") == []
    wait_for(lambda: [e for e in ns_node.events("workers.stopped") if e["ts"] > t_cut], 30,
             what="the cut node's workers stopped")
    assert not any(e["ts"] > fenced[0]["ts"] for e in ns_node.events("train.step"))

    # The link comes back: the node may rejoin; the job is over, so its agent ends, and it never wrote.
    job.lab.heal()
    assert ns_node.proc.wait(timeout=60) in (0, 1), ns_node.log.read_text()[-3000:]
    assert ns_node.events("agent.crashed") == []
    assert late_manifests(job, ns_node, t_lost) == []
