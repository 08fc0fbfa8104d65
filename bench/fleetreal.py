"""P9 on the agent's own code: N nodes of petctl's real rendezvous in one process or a few, against one
real etcd (issue 47).

    python bench/fleetreal.py --nodes 8,16,32 --reps 3 --out bench/results/fleetreal.json
    python bench/fleetreal.py --nodes 128,256 --procs 4 --reps 3   # the nodes dealt over 4 processes

bench/fleet.py runs a model of the rendezvous; this runs the agent's code itself, each node as the
agent builds it (agent/agent.py): its own `Store` session (`open_store`, as in production: on v3 its own
gRPC channel and event loop), `StoreHealth`, `LeaseClasses`, `LiveWatcher`, `Heartbeat` and
`EtcdRendezvous`, with the agent's timeouts. What it leaves out: workers, the round runner, the peer
watch, the event sink and the status (none of them is on the path to ranked), and every node's own
interpreter (the nodes of a process share it: its imports are paid once, and its GIL is shared, which a
host of its own would not share).

Shared where production has one per process, and said so: on v3 every node's store in a process runs on
that process's one asyncio loop thread (gRPC's asyncio client serves one event loop per process; a loop
per store fails when one closes), each store still with its own channel and session.

`--procs P` deals the nodes round-robin over P shard processes (spawned: a forked gRPC is unsafe). Each
builds its nodes, then all start on one go from this process. Times are CLOCK_MONOTONIC, one clock for
every process of the host. One process saturates between 64 and 128 nodes on 2 cores; more processes
spread the client's work, but on 2 cores they still share them with etcd.

Each node runs in a thread: it registers (`Heartbeat.start`: its key under `live/nodes/`, as the agent
does before its rendezvous), starts its watch and calls `next_rendezvous`. The clock starts at the
first node's registration. Reported, per N:
- `mass_join_s`: the first registration → the last (every node booting at once);
- `ranking_s`: the last registration → every node knows its rank (`rendezvous.complete`);
- `ranked_s`: the first registration → every node ranked (the sum);
- requests per node to ranked (the agents' own count) and the CPU per node of the processes that ran them;
- etcd's own CPU per node from before the nodes were built (their sessions, leases and watches) to every
  node ranked (`process_cpu_seconds_total`, in ticks of 0.01 s): what a fleet's start costs the one
  etcd host;
- keys read per node to ranked (`RequestStats.keys_read`: what its reads returned; one per node in the
  job for a whole read of `live/` or of the round's join records, which only the closer makes since
  the joiners look for a live joiner ahead of them instead). Its mean and max (the closer's);
- `cpu_bound_s`: the least time the run's own CPU allows (`cpu_bound_s`, the utilization law): the
  busiest of the shard processes (one core each at most: an interpreter's GIL) and the host's cores
  (which also run etcd), its work over its capacity. `ranked_s` near it says the ranking was the host's
  CPU queue, not the protocol's waits; `tests/bench/test_fleetreal.py` holds every committed size (the
  median of its runs' time over bound) to 30 % of it. `--bound-from RESULT` carries a result's per-node
  work to other sizes and hosts (a bound, not a run: what it leaves out is in `bound_at`'s docstring);
- `saturated`: a node's heartbeat ran late (two applied keep-alives `LATE_S` or more further apart than
  the interval, `Heartbeat.longest_gap`), the process's shared event loop ran a 50 ms timer `LATE_S` or
  more late (`LoopLag`, v3), or a node missed `--timeout`: this process, not petctl, was the
  bottleneck. Such a run is marked invalid in the table and the JSON and is never quoted.

`--timeouts` picks the agent timeouts the nodes run with: `local` (the defaults, what the local provider
runs: a keep-alive every 0.2 s) or `aws` (what an AWS job runs, `aws_timeouts`: one every 2 s). A fleet
of hundreds of nodes is an AWS job, and its keep-alives are a tenth of the local ones: on one machine
they are most of what the fleet's processes do at rest. The rule for a late beat is the same for both.

With `--rest-s W` every valid run then holds its nodes up, ranked, for `--settle-s` and W more seconds
(heartbeats and watches running, nothing else) and reads etcd's /metrics at both ends of the W: raft
proposals (`etcd_server_proposals_committed_total`), requests (gRPC messages received, by service) and
etcd's own CPU, per node per 10 s at rest (`rest`). A heartbeat or the loop late while the nodes are
held (the settle and the window) makes the window invalid (`rest.valid`), by the rule of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path, like bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import runmeta  # noqa: E402
from petctl.agent.decisions import Settings  # noqa: E402
from petctl.agent.health import OutageReporter, StoreHealth  # noqa: E402
from petctl.agent.leases import LeaseClasses  # noqa: E402
from petctl.agent.liveness import Heartbeat  # noqa: E402
from petctl.agent.rendezvous import EtcdRendezvous, LiveWatcher, RequestStats  # noqa: E402
from petctl.core.keys import JobKeys  # noqa: E402
from petctl.core.records import NodeRecord  # noqa: E402
from petctl.core.spec import JobSpec  # noqa: E402
from petctl.core.store import JOB_DEFAULT_BACKEND, Store, StoreError  # noqa: E402
from petctl.io.eventlog import EventLog  # noqa: E402
from petctl.io.store import open_store  # noqa: E402

STORE_MARGIN = 1.0  # as agent.py's: the store health's grace beyond one TTL and one refresh
_loop: Any = None  # the v3 stores' one event loop thread (module docstring), made on first use


def shared_loop() -> Any:
    """This process's one LoopThread for every v3 store of every run (never closed: a daemon thread)."""
    global _loop
    if _loop is None:
        from petctl.io.store.v3 import LoopThread

        _loop = LoopThread("fleetreal-loop")
    return _loop


@dataclass
class Node:
    """One simulated instance: the agent's rendezvous parts, built as agent/agent.py builds them."""

    node_id: str
    kv: Store
    heartbeat: Heartbeat
    watcher: LiveWatcher
    rdzv: EtcdRendezvous
    stats: RequestStats
    registered: float | None = None  # monotonic
    ranked: float | None = None
    rank: int | None = None
    error: str = ""
    log: io.StringIO = field(default_factory=io.StringIO)


def build(spec: JobSpec, node_id: str) -> Node:
    """A node's parts on a store session of its own (no etcd call yet)."""
    t = spec.timeouts
    out = io.StringIO()  # the events, kept for a failure's report
    events = EventLog("agent", stream=out, job=spec.name, node=node_id)
    emit = events.emit
    timeout = min(5.0, max(1.0, t.heartbeat_ttl - t.heartbeat_interval))
    health = StoreHealth(emit, grace=t.heartbeat_ttl + t.heartbeat_interval + STORE_MARGIN,
                         slow=max(t.heartbeat_ttl - t.heartbeat_interval, t.heartbeat_ttl / 2),
                         straggle=timeout)
    kv = open_store(spec.etcd_endpoint, spec.etcd_store, None, timeout,  # type: ignore[arg-type]
                    loop=shared_loop() if spec.etcd_store == "v3" else None)
    keys = JobKeys(spec.name)
    stats = RequestStats()
    watcher = LiveWatcher(kv, keys.live, stats, OutageReporter("watch", emit, parent=health))
    heartbeat = Heartbeat(kv, keys, NodeRecord(node_id=node_id, host_addr="127.0.0.1", pid=os.getpid()),
                          t.heartbeat_interval, t.heartbeat_ttl,
                          OutageReporter("heartbeat", emit, parent=health), health, events)
    rdzv = EtcdRendezvous(kv, LeaseClasses(kv), spec.name, node_id, "127.0.0.1", Settings.of(node_id, spec),
                          events, watcher, stats, health)
    return Node(node_id, kv, heartbeat, watcher, rdzv, stats, log=out)


@dataclass(frozen=True)
class NodeResult:
    """What one node did, as a shard process sends it back (monotonic clock: one for every process of the
    host, so shards compare)."""

    node_id: str
    registered: float | None
    ranked: float | None
    rank: int | None
    longest_gap: float  # the longest stretch between two applied keep-alives (Heartbeat.longest_gap)
    requests: int  # the node's own count of store requests to ranked (RequestStats)
    error: str = ""
    keys_read: int = 0  # keys its reads returned to ranked (RequestStats.keys_read)

    @classmethod
    def of(cls, node: Node) -> NodeResult:
        return cls(node.node_id, node.registered, node.ranked, node.rank, node.heartbeat.longest_gap,
                   sum(node.stats.as_dict().values()), node.error, node.stats.keys_read)


def _run_node(node: Node, go: threading.Event, abort: threading.Event) -> None:
    go.wait()
    try:
        node.heartbeat.start()
        node.registered = time.monotonic()
        node.watcher.start(after=node.heartbeat.revision, membership=False)  # as agent.py starts it
        info = node.rdzv.next_rendezvous(None, abort.is_set)
        node.ranked, node.rank = time.monotonic(), info.rank
    except Exception as e:  # noqa: BLE001 - recorded on the node and reported in the run's errors
        node.error = f"{type(e).__name__}: {e}"


LATE_S = 0.3  # a keep-alive, or the loop's timer, this late: the bench's process was the bottleneck
LAG_PERIOD = 0.05  # how often `LoopLag` times the shared loop
# The default wait between the last rank and the window at rest, in keep-alive intervals (and at least
# 2 s): every node's first keep-alive, an interval after its registration was answered, falls before it.
SETTLE_INTERVALS = 2.5


def job_spec(endpoint: str, name: str, n: int, store: str, timeouts: str = "local") -> JobSpec:
    """The bench job: `n` nodes, fixed size, with the agent timeouts `timeouts` names (bench/rest.py's
    `timeouts_named`: the defaults, or an AWS job's). Raises ValueError for an unknown name."""
    from bench.rest import timeouts_named

    spec = JobSpec(name=name, min_size=n, max_size=n, size=n, entrypoint="none.py", etcd_endpoint=endpoint)
    spec.etcd_store = store
    spec.timeouts = timeouts_named(timeouts)
    return spec


def late_gap(spec: JobSpec) -> float:
    """The longest gap between two applied keep-alives that a valid run allows: the interval plus
    `LATE_S` (0.5 s with the local timeouts, 2.3 s with AWS's)."""
    return spec.timeouts.heartbeat_interval + LATE_S


class LoopLag:
    """How late a timer ran on this process's shared loop (`shared_loop`), the worst so far. Why: every
    node of the process waits on that one loop (and on the GIL), so its lateness is the delay the harness
    adds to each request. A late keep-alive shows it too, but only where a keep-alive falls: at an AWS
    job's one per 2 s, a ranking of a second may see none."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.worst = 0.0
        self._loop = loop
        self._stopped = threading.Event()

    def start(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._arm)

    def stop(self) -> None:
        self._stopped.set()

    def _arm(self) -> None:
        if not self._stopped.is_set():
            due = self._loop.time() + LAG_PERIOD  # type: ignore[union-attr]
            self._loop.call_at(due, self._tick, due)  # type: ignore[union-attr]

    def _tick(self, due: float) -> None:
        self.worst = max(self.worst, self._loop.time() - due)  # type: ignore[union-attr]
        self._arm()


def run_nodes(spec: JobSpec, ids: list[str], timeout: float,
              ready: Callable[[], None] = lambda: None,
              hold: Callable[[list[NodeResult], float, float], None] | None = None, settle_s: float = 0.0
              ) -> tuple[list[NodeResult], float, float, float]:
    """Build the nodes `ids` (each on a store session of its own), call `ready` (a shard waits there for
    the driver's go), start them all at once and wait until each is ranked or `timeout` passed. Then
    `hold(results, cpu, lag)`, if given, runs while the nodes stay up (the rest window), before they are
    closed. Returns each node's result, the CPU seconds this process spent from the go to the last rank,
    and the longest heartbeat gap of any node and the loop's worst lag (`LoopLag`) from `settle_s` into
    `hold` on (`lag` is the loop's worst up to the last rank). Why not before: the window at rest is
    judged on itself, and a node's first keep-alive comes an interval after its registration was answered,
    so its gap holds the registration's wait in the mass join (an AWS job's interval is 2 s, longer than
    a ranking). The bench resets the heartbeats' record of their longest gap for that, which no agent
    does."""
    nodes = [build(spec, i) for i in ids]
    go, abort = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_run_node, args=(node, go, abort), name=node.node_id, daemon=True)
               for node in nodes]
    lag = LoopLag(shared_loop().loop if spec.etcd_store == "v3" else None)
    try:
        for t in threads:
            t.start()
        ready()
        lag.start()
        cpu0 = time.process_time()
        go.set()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        abort.set()  # a node not ranked by now stops trying; the ranked ones' threads have ended
        cpu = time.process_time() - cpu0
        results = [NodeResult.of(node) for node in nodes]
        ranked_lag = lag.worst

        def judge_from_now() -> None:
            lag.worst = 0.0
            for node in nodes:
                node.heartbeat.longest_gap = 0.0

        settled = threading.Timer(settle_s, judge_from_now)
        settled.start()
        if hold is not None:
            hold(results, cpu, ranked_lag)
        settled.join()
        return results, cpu, max((node.heartbeat.longest_gap for node in nodes), default=0.0), lag.worst
    finally:
        lag.stop()
        abort.set()
        go.set()
        for node in nodes:
            _close(node)
        for t in threads:
            t.join(5.0)


def _shard_main(conn: Any, endpoint: str, name: str, n: int, ids: list[str], store: str,
                timeout: float, timeouts: str, settle_s: float) -> None:
    """A shard process: its share of the nodes, started on the driver's go; sends back (results, cpu)
    once they are ranked, keeps them up until the driver's "close" (after its rest window), then sends
    their longest heartbeat gap; or ("error", message) when it could not run them."""
    def ready() -> None:
        conn.send("ready")
        conn.recv()

    def hold(results: list[NodeResult], cpu: float, lag: float) -> None:
        conn.send((results, cpu, lag))
        conn.recv()

    try:
        _, _, gap, lag = run_nodes(job_spec(endpoint, name, n, store, timeouts), ids, timeout, ready, hold,
                                   settle_s)
        conn.send(("gap", gap, lag))
    except Exception as e:  # noqa: BLE001 - the driver raises it, with the shard's message
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _run_shards(endpoint: str, name: str, n: int, ids: list[str], store: str, timeout: float,
                procs: int, hold: Callable[[list[NodeResult], float, float], None], timeouts: str = "local",
                settle_s: float = 0.0) -> tuple[list[NodeResult], float, float, float]:
    """The nodes dealt round-robin over `procs` processes, each with its own interpreter, GIL and event
    loop. The go goes to every shard once all have built their nodes; `hold` runs once every shard has
    sent its results, with every node still up. Returns what `run_nodes` returns, over all shards.
    Raises RuntimeError with a shard's error."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork: a forked gRPC or a forked thread is unsafe
    shards = []
    for k in range(procs):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_shard_main, args=(child, endpoint, name, n, ids[k::procs], store, timeout,
                                                  timeouts, settle_s), daemon=True)
        p.start()
        shards.append((p, parent))
    try:
        for _, conn in shards:
            answer = conn.recv()
            if answer != "ready":
                raise RuntimeError(f"a shard failed before its nodes were built: {answer[1]}")
        for _, conn in shards:
            conn.send("go")
        results: list[NodeResult] = []
        cpu = lag = 0.0
        for _, conn in shards:
            answer = conn.recv()
            if answer[0] == "error":
                raise RuntimeError(f"shard: {answer[1]}")
            results += answer[0]
            cpu += answer[1]
            lag = max(lag, answer[2])
        hold(results, cpu, lag)
        for _, conn in shards:
            conn.send("close")
        gap = lag = 0.0
        for _, conn in shards:
            answer = conn.recv()
            if answer[0] == "error":
                raise RuntimeError(f"shard: {answer[1]}")
            gap, lag = max(gap, answer[1]), max(lag, answer[2])
        return results, cpu, gap, lag
    finally:
        for p, conn in shards:
            conn.close()
            p.join(10.0)
            if p.is_alive():
                p.kill()


def run_once(endpoint: str, n: int, store: str = JOB_DEFAULT_BACKEND, timeout: float = 120.0,
             procs: int = 1, rest_s: float = 0.0, settle_s: float | None = None,
             timeouts: str = "local") -> dict[str, Any]:
    """One fleet of `n` nodes from start to every node ranked, in this process (`procs` 1) or dealt over
    `procs` shard processes, with the agent timeouts `timeouts` names; with `rest_s`, then its window at
    rest (after `settle_s`, by default 2.5 keep-alive intervals and at least 2 s) while the nodes stay up;
    the figures of the module docstring."""
    name = f"fleetreal{n}x{int(time.time() * 1000) % 10**8}"
    spec = job_spec(endpoint, name, n, store, timeouts)
    interval = spec.timeouts.heartbeat_interval
    settle = settle_s if settle_s is not None else max(2.0, SETTLE_INTERVALS * interval)
    judged_after = settle if rest_s > 0 else 0.0  # no window: nothing to hold the nodes up for
    ids = [f"n{i:04d}" for i in range(n)]
    rested: dict[str, Any] = {}
    formed: dict[str, float] = {}
    etcd_cpu0 = etcd_cpu(endpoint)

    def hold(results: list[NodeResult], cpu: float, lag: float) -> None:
        formed["etcd_cpu_s"], formed["lag"] = etcd_cpu(endpoint) - etcd_cpu0, lag
        if rest_s > 0 and all(r.rank is not None for r in results):
            rested.update(rest_window(endpoint, n, settle, rest_s))

    if procs <= 1:
        results, cpu, gap, lag = run_nodes(spec, ids, timeout, hold=hold, settle_s=judged_after)
    else:
        results, cpu, gap, lag = _run_shards(endpoint, name, n, ids, store, timeout, procs, hold, timeouts,
                                             judged_after)
    out = _figures(results, n, store, spec, cpu, formed["lag"])
    out["procs"] = max(1, procs)
    out["timeouts"] = timeouts
    out["etcd_cpu_per_node_s"] = round(formed["etcd_cpu_s"] / n, 5)
    out["cores"] = host_cores()
    out["cpu_bound_s"] = round(cpu_bound_s(n, out["procs"], out["cores"], cpu / n,
                                           formed["etcd_cpu_s"] / n), 4)
    if rested:
        late = late_gap(spec)
        rested.update(valid=out["valid"] and gap < late and lag < LATE_S,
                      longest_heartbeat_gap_s=round(gap, 3), longest_loop_lag_s=round(lag, 3))
        out["rest"] = rested
    return out


def host_cores() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset narrows)."""
    return len(os.sched_getaffinity(0))


def cpu_bound_s(nodes: int, procs: int, cores: int, cpu_per_node_s: float,
                etcd_cpu_per_node_s: float) -> float:
    """The least time `nodes` nodes can be ranked in, from the CPU they and etcd spent: the utilization
    law over the two resources the run shares. The shard processes hold the nodes' work, each at most one
    core (one interpreter, one GIL), `min(procs, cores)` in all; the host's `cores` hold the nodes' work
    and etcd's. Time can exceed the bound by waits (the closer's poll, round trips), never fall below it
    by more than the CPU spent outside the timed window (the nodes' CPU is counted from the go, the time
    from the first registration). Raises ValueError on a size, process or core count below 1."""
    if min(nodes, procs, cores) < 1:
        raise ValueError(f"nodes, procs and cores must be at least 1, got {nodes}, {procs}, {cores}")
    client = nodes * cpu_per_node_s / min(procs, cores)
    host = nodes * (cpu_per_node_s + etcd_cpu_per_node_s) / cores
    return max(client, host)


def bound_at(result: dict[str, Any], nodes: int, cores: int, procs: int) -> dict[str, Any]:
    """A committed fleet result's per-node work carried to `nodes` nodes on `cores` cores in `procs`
    processes: `cpu_bound_s` with the CPU per node (the nodes' and etcd's) of the result's largest size
    whose every run was valid (their medians; a size that saturated in any run was at the host's edge).
    What it leaves out: that work stays flat per node beyond the sizes run (it did from 64 to 256:
    fleetreal-aws-2cores.json), a host that stays unsaturated (at the bound the shard loops run no
    slack, so their keep-alives go late), the protocol's own waits, and hosts of their own, where each
    node's work runs in parallel and only etcd's queues. Raises ValueError when no size has every run
    valid and etcd's CPU measured."""
    sizes = [res for res in result["results"].values()
             if res["summary"]["valid_runs"] and not res["summary"]["invalid_runs"]
             and res["summary"].get("etcd_cpu_per_node_s") is not None]
    if not sizes:
        raise ValueError("the result has no size with every run valid and etcd's CPU measured")
    base = max(sizes, key=lambda res: res["nodes"])
    a, e = base["summary"]["cpu_per_node_s"], base["summary"]["etcd_cpu_per_node_s"]
    return {"nodes": nodes, "cores": cores, "procs": procs, "from_nodes": base["nodes"],
            "cpu_per_node_s": a, "etcd_cpu_per_node_s": e,
            "cpu_bound_s": round(cpu_bound_s(nodes, procs, cores, a, e), 3)}


def rest_window(endpoint: str, n: int, settle_s: float, window_s: float) -> dict[str, Any]:
    """What `n` ranked nodes cost etcd at rest: wait `settle_s`, then bench/rest.py's `etcd_window` over
    `window_s`. Raises as that does."""
    from bench.rest import etcd_window

    time.sleep(settle_s)
    return etcd_window(endpoint, n, window_s)


def etcd_cpu(endpoint: str) -> float:
    """etcd's own CPU seconds so far (bench/rest.py's `metrics`). Raises as that does."""
    from bench.rest import metrics

    return metrics(endpoint)[2]


def _close(node: Node) -> None:
    try:
        node.heartbeat.stop(delete=True)
        node.watcher.stop()
    except StoreError:
        pass  # the keys expire with their leases
    finally:
        node.kv.close()


def _figures(nodes: list[NodeResult], n: int, store: str, spec: JobSpec, cpu: float,
             loop_lag: float = 0.0) -> dict[str, Any]:
    regs = [x.registered for x in nodes if x.registered is not None]
    ranked = [x.ranked for x in nodes if x.ranked is not None]
    gaps = [x.longest_gap for x in nodes]
    late = late_gap(spec)
    errors = sorted({x.error for x in nodes if x.error})
    why = []
    if len(ranked) < n:
        why.append(f"{n - len(ranked)} of {n} nodes not ranked")
    if max(gaps, default=0.0) >= late:
        why.append(f"heartbeats ran late: a gap of {max(gaps):.2f} s (>= {late:.2f} s)")
    if loop_lag >= LATE_S:
        why.append(f"the event loop ran late: by {loop_lag:.2f} s (>= {LATE_S:.2f} s)")
    ranks = sorted(x.rank for x in nodes if x.rank is not None)
    requests = [x.requests for x in nodes]
    keys = [x.keys_read for x in nodes]
    out: dict[str, Any] = {"nodes": n, "store": store, "valid": not why, "saturated": "; ".join(why),
                           "errors": errors[:5], "cpu_per_node_s": round(cpu / n, 4),
                           "longest_heartbeat_gap_s": round(max(gaps, default=0.0), 3),
                           "longest_loop_lag_s": round(loop_lag, 3),
                           "requests_per_node": {"mean": round(statistics.mean(requests), 2),
                                                 "max": max(requests)},
                           "keys_read_per_node": {"mean": round(statistics.mean(keys), 2), "max": max(keys)},
                           "ranks_ok": ranks == list(range(n))}
    if regs and len(ranked) == n:
        first, last = min(regs), max(regs)
        out.update(mass_join_s=round(last - first, 4), ranking_s=round(max(ranked) - last, 4),
                   ranked_s=round(max(ranked) - first, 4))
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the valid runs (None where none was valid), and how many were not."""
    valid = [r for r in runs if r["valid"]]
    def med(key: str, digits: int = 4) -> float | None:
        vals = [r[key] for r in valid if r.get(key) is not None]
        return round(statistics.median(vals), digits) if vals else None
    rests = [r["rest"] for r in valid if r.get("rest", {}).get("valid")]
    def rest_med(key: str, digits: int = 3) -> float | None:
        return round(statistics.median(x[key] for x in rests), digits) if rests else None
    return {"valid_runs": len(valid), "invalid_runs": len(runs) - len(valid),
            **{k: med(k) for k in ("mass_join_s", "ranking_s", "ranked_s", "cpu_per_node_s")},
            "etcd_cpu_per_node_s": med("etcd_cpu_per_node_s", 5),
            "cpu_bound_s": med("cpu_bound_s"),
            "ranked_s_range": ([min(r["ranked_s"] for r in valid), max(r["ranked_s"] for r in valid)]
                               if valid else None),
            "keys_read_per_node": (round(statistics.median(r["keys_read_per_node"]["mean"] for r in valid), 1)
                                   if valid else None),
            "rest_windows": len(rests),
            "rest_proposals_per_node_per_10s": rest_med("proposals_per_node_per_10s"),
            "rest_requests_per_node_per_10s": rest_med("requests_total_per_node_per_10s"),
            "rest_etcd_cpu_per_node_per_10s": rest_med("etcd_cpu_per_node_per_10s", 5)}


def table(results: dict[str, Any]) -> str:
    rows = ["| nodes | store | timeouts | processes | valid runs | first registration → all ranked | "
            "mass join | ranking | CPU bound (work / cores) | CPU / node | etcd CPU / node | "
            "keys read / node | "
            "at rest: proposals / node / 10 s | requests / node / 10 s | etcd CPU s / node / 10 s | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def fmt(v: float | None, unit: str = " s") -> str:
        return "invalid" if v is None else f"{v:g}{unit}"

    def rest(res: dict[str, Any], key: str) -> str:
        if not any("rest" in r for r in res["runs"]):
            return "-"  # no window asked for
        return fmt(res["summary"].get(key), "")

    for res in results.values():
        s = res["summary"]
        note = "; ".join(sorted({r["saturated"] for r in res["runs"] if r["saturated"]}))
        etcd_s = s.get("etcd_cpu_per_node_s")
        etcd = "-" if etcd_s is None and s["valid_runs"] else fmt(etcd_s)  # "-": not read then
        bound_s = s.get("cpu_bound_s")
        bound = "-" if bound_s is None and s["valid_runs"] else fmt(bound_s)  # "-": not computed then
        rows.append(f"| {res['nodes']} | {res['store']} | {res.get('timeouts', 'local')} | "
                    f"{res.get('procs', 1)} | "
                    f"{s['valid_runs']} of {len(res['runs'])} | "
                    f"{fmt(s['ranked_s'])} | {fmt(s['mass_join_s'])} | {fmt(s['ranking_s'])} | {bound} | "
                    f"{fmt(s['cpu_per_node_s'])} | {etcd} | "
                    f"{fmt(s.get('keys_read_per_node'), '')} | "
                    f"{rest(res, 'rest_proposals_per_node_per_10s')} | "
                    f"{rest(res, 'rest_requests_per_node_per_10s')} | "
                    f"{rest(res, 'rest_etcd_cpu_per_node_per_10s')} | {note} |")
    return "\n".join(rows)


def print_bounds(path: Path, sizes: list[int], cores: list[int], procs: int) -> int:
    """`bound_at` for each size and core count, as a table on stdout; 2 with a one-line error on stderr
    when the file is missing or not a fleet result."""
    if not sizes or not cores:
        print("fleetreal: --bound-from needs at least one size (--nodes) and one core count", file=sys.stderr)
        return 2
    try:
        result = json.loads(path.read_text())
        rows = [bound_at(result, n, c, procs) for c in cores for n in sizes]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"fleetreal: cannot carry {path}: {e}", file=sys.stderr)
        return 2
    print(f"The CPU bound from {path.name} (commit {str(result.get('commit'))[:7]}), "
          f"per-node work at N={rows[0]['from_nodes']}: the nodes' {rows[0]['cpu_per_node_s']} s, "
          f"etcd's {rows[0]['etcd_cpu_per_node_s']} s. A bound, not a run.")
    print("| nodes | cores | processes | CPU bound |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r['cores']} | {r['procs']} | {r['cpu_bound_s']} s |")
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench.rest import TIMEOUTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="8,16,32", help="comma-separated fleet sizes")
    parser.add_argument("--store", default=JOB_DEFAULT_BACKEND, choices=("v3", "v2"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--procs", type=int, default=1,
                        help="shard processes the nodes are dealt over (1: every node in this process)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for every node to be ranked")
    parser.add_argument("--rest-s", type=float, default=0.0,
                        help="hold the ranked nodes up this long; count what etcd sees (0: no window)")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="the wait after the last rank, first (default: 2.5 keep-alives, >= 2 s)")
    parser.add_argument("--timeouts", default="local", choices=TIMEOUTS,
                        help="the agent timeouts the nodes run with: the defaults, or an AWS job's")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"
                                             / "fleetreal-latest.json"))
    parser.add_argument("--bound-from", default=None, metavar="RESULT",
                        help="run nothing: carry this result's per-node work to --nodes on --cores cores "
                             "in --procs processes (`bound_at`)")
    parser.add_argument("--cores", default=None,
                        help="with --bound-from: comma-separated core counts (default: this host's)")
    args = parser.parse_args(argv)
    if args.bound_from:
        return print_bounds(Path(args.bound_from), [int(x) for x in args.nodes.split(",") if x],
                            [int(x) for x in (args.cores or str(host_cores())).split(",") if x], args.procs)
    import shutil
    import signal
    import tempfile

    from petctl.io.etcd import EtcdServer

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the `finally`: etcd is stopped
    meta = runmeta.start()
    scratch = Path(tempfile.mkdtemp(prefix="petctl-fleetreal-"))
    etcd = EtcdServer.start(scratch / "etcd", log_path=scratch / "etcd.log")
    results: dict[str, Any] = {}
    try:
        for n in [int(x) for x in args.nodes.split(",") if x]:
            runs = []
            for rep in range(args.reps):
                runs.append(run_once(etcd.endpoint, n, args.store, args.timeout, args.procs, args.rest_s,
                                     args.settle_s, args.timeouts))
                print(json.dumps({"rep": rep, **runs[-1]}), flush=True)
            results[f"{args.store}/N={n}"] = {"nodes": n, "store": args.store, "procs": args.procs,
                                              "timeouts": args.timeouts, "runs": runs,
                                              "summary": summarize(runs)}
    finally:
        etcd.stop(remove_data=True)
        shutil.rmtree(scratch, ignore_errors=True)
    runmeta.write(meta, Path(args.out), table(results), title="P9 on the agent's own rendezvous code",
                  results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
