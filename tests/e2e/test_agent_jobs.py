"""The elastic agent against a real etcd and real gloo workers, without any provider in between.

Each test starts agents as separate process groups (one per simulated instance), changes membership
the way the outside world does (SIGKILL, SIGSTOP, SIGTERM, a new agent) and asserts what the job must
do: ranks, world sizes, restart accounting and the final result, as published in etcd and in the steps
the workers actually ran.
"""

from __future__ import annotations

import itertools
import json
import signal
import time

import pytest

from tests.support.agent_harness import WORKLOADS, AgentCluster, dump, make_spec, wait_for, wait_ready

pytestmark = pytest.mark.slow
_names = itertools.count()


@pytest.fixture
def cluster_factory(etcd_server, tmp_path):
    clusters: list[AgentCluster] = []

    def make(**kwargs) -> AgentCluster:
        spec = make_spec(f"job{next(_names)}", etcd_server.endpoint, **kwargs)
        cluster = AgentCluster(etcd_server.endpoint, tmp_path / spec.name, spec)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop_all()


def frozen_world(cluster: AgentCluster, size: int):
    def check():
        st = cluster.state()
        return st if st.state == "running" and st.world_size == size else None
    return check


def trained_at(cluster: AgentCluster, node_id: str, world: int, after: float) -> bool:
    return any(s["world_size"] == world and s["ts"] > after for s in cluster.steps(node_id))


def test_two_nodes_form_ranks_and_succeed(cluster_factory):
    cluster = cluster_factory(min_size=2, max_size=2, env={"STEPS": "15", "STEP_TIME": "0.05"})
    a, b = cluster.start(), cluster.start()
    st = wait_for(frozen_world(cluster, 2), 30, what="world of 2")
    assert sorted(st.ranks.values()) == [0, 1]
    assert set(st.ranks) == {a.node_id, b.node_id}
    assert a.proc.wait(timeout=60) == 0 and b.proc.wait(timeout=60) == 0
    final = cluster.state()
    assert final.result.state == "succeeded", dump(final.to_dict())
    # Every rank ran every step at world size 2, in one round.
    for agent in (a, b):
        steps = agent.events("train.step")
        assert [s["step"] for s in steps] == list(range(15))
        assert {s["world_size"] for s in steps} == {2}
        assert len(agent.events("rendezvous.complete")) == 1


def test_a_rank_stuck_at_exit_does_not_hold_the_job_forever(cluster_factory):
    """Once a rank exited 0, the others get finish_grace to exit; one stuck at exit (as seen in
    destroy_process_group after its peer left) is stopped and the job still ends succeeded."""
    cluster = cluster_factory(min_size=2, max_size=2, finish_grace=3.0,
                              env={"STEPS": "5", "STEP_TIME": "0.05", "HANG_AT_EXIT_RANK": "1"})
    a, b = cluster.start(), cluster.start()
    assert a.proc.wait(timeout=90) == 0 and b.proc.wait(timeout=90) == 0
    assert cluster.state().result.state == "succeeded"
    lingered = [n for n in (a, b) if n.events("workers.lingered")]
    assert len(lingered) == 1
    assert lingered[0].events("workers.started")[0]["rank"] == 1


def test_killed_node_reforms_smaller_then_grows_back(cluster_factory):
    cluster = cluster_factory(min_size=1, max_size=3, size=3)
    nodes = [cluster.start() for _ in range(3)]
    st = wait_for(frozen_world(cluster, 3), 30, what="world of 3")
    rank0 = next(n for n, r in st.ranks.items() if r == 0)
    victim = next(a for a in nodes if st.ranks[a.node_id] == 2)
    t_kill = time.time()
    victim.signal_group(signal.SIGKILL)
    st2 = wait_for(frozen_world(cluster, 2), 20, what="world of 2 after kill")
    survivor = next(a for a in nodes if a is not victim and a.node_id != rank0)
    wait_for(lambda: trained_at(cluster, survivor.node_id, 2, t_kill), 20, what="steps at world 2")
    assert st2.ranks[rank0] == 0, "rank 0 survived and must stay rank 0"
    assert st2.round.restarts == 0, "a lost node is a membership change, not a failure"
    assert victim.node_id not in st2.ranks
    # A replacement instance joins: the job grows back to 3.
    t_join = time.time()
    newcomer = cluster.start()
    wait_ready([newcomer])  # its imports, at the machine's speed; then the join, at the product's
    st3 = wait_for(frozen_world(cluster, 3), 20, what="world of 3 after replacement")
    assert newcomer.node_id in st3.ranks and st3.ranks[rank0] == 0
    wait_for(lambda: trained_at(cluster, newcomer.node_id, 3, t_join), 30, what="newcomer trains")


def test_frozen_node_is_dropped_within_seconds_and_rejoins_after_thaw(cluster_factory):
    cluster = cluster_factory(min_size=1, max_size=2, size=2)
    a, b = cluster.start(), cluster.start()
    st = wait_for(frozen_world(cluster, 2), 30, what="world of 2")
    frozen = a if st.ranks[a.node_id] == 1 else b
    other = b if frozen is a else a
    t_freeze = time.time()
    frozen.signal_group(signal.SIGSTOP)  # sockets stay open: only the heartbeat can tell
    wait_for(lambda: trained_at(cluster, other.node_id, 1, t_freeze), 15, what="survivor trains alone")
    resumed_after = min(s["ts"] for s in cluster.steps(other.node_id)
                        if s["ts"] > t_freeze and s["world_size"] == 1) - t_freeze
    assert resumed_after < 15, f"survivor resumed {resumed_after:.1f}s after the freeze"
    assert cluster.state().round.restarts == 0
    t_thaw = time.time()
    frozen.signal_group(signal.SIGCONT)
    st2 = wait_for(frozen_world(cluster, 2), 20, what="thawed node rejoins")
    assert frozen.node_id in st2.ranks
    assert any(e["ts"] > t_thaw for e in frozen.events("heartbeat.lost"))
    wait_for(lambda: trained_at(cluster, frozen.node_id, 2, t_thaw), 30, what="thawed node trains")


def test_graceful_leave_reforms_without_waiting_for_ttl(cluster_factory):
    cluster = cluster_factory(min_size=1, max_size=2, size=2, heartbeat_ttl=30.0)
    a, b = cluster.start(), cluster.start()
    st = wait_for(frozen_world(cluster, 2), 30, what="world of 2")
    leaver = a if st.ranks[a.node_id] == 1 else b
    stayer = b if leaver is a else a
    t_term = time.time()
    leaver.proc.send_signal(signal.SIGTERM)
    assert leaver.proc.wait(timeout=15) == 0
    reformed = wait_for(lambda: [e for e in stayer.events("rendezvous.complete")
                                 if e["ts"] > t_term and e["world_size"] == 1], 30, what="re-formed at 1")
    # With a 30 s TTL, only the graceful leave can explain a re-form this fast. The round is what the leave
    # decides; the first step after it also waits for worker start-up, which load stretches (seen > 15 s
    # with the suite running twice on 2 cores), so it is checked apart, with room.
    assert reformed[0]["ts"] - t_term < 10
    wait_for(lambda: trained_at(cluster, stayer.node_id, 1, t_term), 60, what="training at world size 1")


def test_worker_failures_count_and_exhaust_max_restarts(cluster_factory):
    cluster = cluster_factory(min_size=2, max_size=2, max_restarts=1,
                              env={"CRASH_AT": "3", "STEP_TIME": "0.05"})
    a, b = cluster.start(), cluster.start()
    assert a.proc.wait(timeout=90) == 1 and b.proc.wait(timeout=90) == 1
    final = cluster.state()
    assert final.result.state == "failed"
    assert "max_restarts=1 exhausted" in final.result.reason
    assert "worker failure" in final.result.reason
    restarts = [e for agent in (a, b) for e in agent.events("rendezvous.restart")]
    assert [e["restarts"] for e in restarts if e["failure"]] == [1], dump(restarts)
    # TORCHELASTIC_RESTART_COUNT seen by the workers went 0 then 1.
    assert {s["restart"] for s in cluster.steps(a.node_id)} == {"0", "1"}


def test_below_min_for_too_long_fails_the_job(cluster_factory):
    cluster = cluster_factory(min_size=2, max_size=2, join_timeout=3.0, initial_wait=1.0)
    lone = cluster.start()
    assert lone.proc.wait(timeout=30) == 1
    result = cluster.state().result
    assert result.state == "failed" and "fewer than min=2" in result.reason


def test_etcd_writes_per_node_per_round_are_bounded(cluster_factory):
    cluster = cluster_factory(min_size=1, max_size=4, size=4, env={"STEP_TIME": "0.05"})
    nodes = [cluster.start() for _ in range(4)]
    st = wait_for(frozen_world(cluster, 4), 30, what="world of 4")
    victim = next(a for a in nodes if st.ranks[a.node_id] == 3)
    victim.signal_group(signal.SIGKILL)
    wait_for(frozen_world(cluster, 3), 20, what="world of 3")
    time.sleep(6)  # one status publication later
    st = cluster.state()
    rounds = st.round.round
    for node_id, node in st.nodes.items():
        writes = node.etcd_requests["writes"]
        # join + open-next-round CAS + freeze CAS + cleanup, per round: a constant, whatever N.
        assert writes <= 6 * rounds, f"{node_id}: {writes} writes in {rounds} rounds"


def test_restart_hands_the_round_to_warm_workers(cluster_factory):
    """After a restart the workers come from the warm pool (started, torch imported, during the previous
    round) rather than from a cold `python script.py`; how much faster that is lives in bench/."""
    cluster = cluster_factory(min_size=1, max_size=2, size=2, env={"STEP_TIME": "0.05"})
    a, b = cluster.start(), cluster.start()
    st = wait_for(frozen_world(cluster, 2), 30, what="world of 2")
    keeper = a if st.ranks[a.node_id] == 0 else b
    leaver = b if keeper is a else a
    wait_for(lambda: len(cluster.steps(keeper.node_id)) > 5, 30, what="steady training")
    leaver.proc.send_signal(signal.SIGTERM)
    started = wait_for(lambda: [e for e in keeper.events("workers.started") if e["round"] == 2], 20)
    assert started[0]["warm"] == 1
    # Each node joined only once its first warm worker had finished importing (torch, torch._dynamo).
    for node in (keeper, leaver):
        # The start-up report (a refill's report carries its round and may come later or not at all).
        (ready,) = [e for e in node.events("workers.warm_ready") if e.get("round") is None]
        assert ready["count"] == 1
        assert ready["ts"] < node.events("rendezvous.joined")[0]["ts"]
    first_round = [e for e in keeper.events("workers.started") if e["round"] == 1]
    assert first_round[0]["warm_ready"] == 1
    wait_for(lambda: trained_at(cluster, keeper.node_id, 1, started[0]["ts"]), 20, what="warm worker trains")


def test_events_reach_etcd_and_the_mirror(cluster_factory, tmp_path):
    """The job's timeline is kept twice: in etcd (`events/`) for a running job and in the job's prefix
    (here file://) so it outlives etcd; status and the node log are mirrored too."""
    from contextlib import closing

    from petctl.core.keys import JobKeys
    from tests.support.store import store_for

    mirror = tmp_path / "mirror"
    cluster = cluster_factory(min_size=1, max_size=1, env={"STEPS": "6", "STEP_TIME": "0.05"})
    cluster.status_url = f"file://{mirror}"
    node = cluster.start()
    assert node.proc.wait(timeout=60) == 0
    events_key = JobKeys(cluster.spec.name).events
    with closing(store_for(cluster.endpoint, backend=cluster.spec.etcd_store)) as store:
        listing = store.list(events_key)  # in key order, which is each node's write order
    records = [json.loads(entry.value) for entry in listing.entries]
    names = [r["event"] for r in records]
    for expected in ("agent.started", "rendezvous.complete", "workers.started", "round.summary",
                     "job.result"):
        assert expected in names, names
    summary = next(r for r in records if r["event"] == "round.summary")
    assert (summary["first_step"], summary["last_step"], summary["world_size"]) == (0, 5, 1)
    # petctl-agent ran its imports through the dataclass method cache, and says so once
    cache = next(r for r in records if r["event"] == "agent.started")["method_cache"]
    assert cache["hits"] + cache["compiled"] > 100 and "problem" not in cache, cache
    def stream(kind: str) -> str:  # append-only chunks in write order (core/mirrorchunks.py)
        chunks = sorted((mirror / kind / node.node_id).iterdir())
        return "".join(p.read_text() for p in chunks if not p.name.startswith("."))

    mirrored = [json.loads(line)["event"] for line in stream("events").splitlines()]
    assert mirrored == names
    status = json.loads((mirror / "status" / f"{node.node_id}.json").read_text())
    assert status["state"] == "succeeded"
    # Every service's failure count is published, even when (as here) nothing failed.
    assert status["failures"] == {"watch": 0, "heartbeat": 0, "peers": 0, "events": 0, "status": 0,
                                  "records": 0, "sinks": 0, "mirror": 0, "rendezvous": 0, "store_outages": 0,
                                  "launch_hook": 0}
    assert '"event": "train.step"' in stream("logs")


def test_entrypoint_without_py_suffix_is_warm_and_reports_readiness_once_per_fill(cluster_factory, tmp_path):
    """`--entrypoint train`: the pool used to stay empty (only `*.py` counted), and the agent then started a
    readiness reporter on every 0.1 s loop pass: ~10 `workers.warm_ready` events a second, into the node
    log, etcd and the mirror. Now it is warm like any script, and each fill reports once."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train").write_text((WORKLOADS / "steps.py").read_text())
    cluster = cluster_factory(min_size=1, max_size=1, env={"STEPS": "40", "STEP_TIME": "0.05"})
    cluster.spec.entrypoint = "train"
    cluster.spec.code_url = f"file://{code}"
    node = cluster.start()
    assert node.proc.wait(timeout=90) == 0
    assert [s["step"] for s in node.events("train.step")] == list(range(40))
    (started,) = node.events("workers.started")
    assert (started["warm"], started["warm_ready"]) == (1, 1)
    ready = node.events("workers.warm_ready")
    # One at start, at most one for the refill after the first step: never one per loop pass.
    assert 1 <= len(ready) <= 2, ready
    assert ready[0]["count"] == 1


THREADS_SCRIPT = '''
import json, os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
print(json.dumps({"ts": time.time(), "event": "train.step", "step": 0, "rank": dist.get_rank(),
                  "world_size": dist.get_world_size(), "omp": os.environ.get("OMP_NUM_THREADS"),
                  "threads": torch.get_num_threads()}), flush=True)
dist.barrier()  # gloo's init does not wait for the peer's side: leaving at once can close it under its feet
dist.destroy_process_group()
'''


def test_a_node_of_several_workers_gets_torchruns_one_thread_each_unless_the_job_sets_it(
        cluster_factory, tmp_path, monkeypatch):
    """Two workers on a node: OMP_NUM_THREADS=1 in their environment, in torch's pool from the fork
    server's imports on (OpenMP reads it once, at load), and one `workers.threads` event; a job that sets
    it keeps its own."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the host sets none, as on a stock AMI
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    plain, own = (cluster_factory(min_size=1, max_size=1, env=env) for env in ({}, {"OMP_NUM_THREADS": "2"}))
    for cluster in (plain, own):
        cluster.spec.nproc_per_node = 2
        cluster.spec.entrypoint = "threads.py"
        cluster.spec.code_url = f"file://{script}"
    nodes = plain.start(), own.start()
    for node in nodes:
        assert node.proc.wait(timeout=90) == 0
    seen = [sorted((s["rank"], s["omp"], s["threads"]) for s in node.events("train.step")) for node in nodes]
    assert seen == [[(0, "1", 1), (1, "1", 1)], [(0, "2", 2), (1, "2", 2)]]
    assert [e["omp_num_threads"] for e in nodes[0].events("workers.threads")] == [1]
    assert nodes[1].events("workers.threads") == []


STUCK_AT_EXIT_SCRIPT = '''
import atexit, json, os, threading, time
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo")
out = Path(os.environ["OUT_DIR"])
print(json.dumps({"ts": time.time(), "event": "train.step", "step": 0, "rank": dist.get_rank(),
                  "world_size": dist.get_world_size()}), flush=True)
dist.destroy_process_group()
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(1.0), (out / "thread").write_text("done"))).start()


class Stuck:
    """Freeing it never returns: the shape of a gloo group's destructor deadlocked at exit."""

    def __del__(self):
        time.sleep(3600)


stuck = Stuck()
'''


def test_a_worker_stuck_at_exit_after_its_script_finished_is_stopped_and_the_job_succeeds(cluster_factory,
                                                                                          tmp_path):
    """The script returned, its thread and atexit handler ran, and then freeing its objects hangs: the
    worker said `worker.exiting`, so the agent stops it after exit_grace (10 s), not finish_grace (60 s,
    which no rank exiting 0 would ever start here), and the node counts as done."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_AT_EXIT_SCRIPT)
    cluster = cluster_factory(min_size=1, max_size=1, env={"OUT_DIR": str(tmp_path)})
    cluster.spec.entrypoint = "stuck.py"
    cluster.spec.code_url = f"file://{script}"
    node = cluster.start()
    assert node.proc.wait(timeout=60) == 0
    assert cluster.state().result.state == "succeeded"
    (exiting,) = node.events("worker.exiting")
    (lingered,) = node.events("workers.lingered")
    assert (lingered["seconds"], lingered["cause"]) == (10.0, "stuck at exit after the script finished")
    assert 10.0 <= lingered["ts"] - exiting["ts"] < 20.0
    # What the script asked for at exit happened before the stop: its thread was joined, atexit ran.
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"
