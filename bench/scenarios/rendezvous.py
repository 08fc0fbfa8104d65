"""P5 rendezvous cost vs size: N nodes running a trivial worker (one line, exit 0) on loopback.

Figures per run:
- `rdzv_s`: from the moment every node's agent is up (petctl: `agent.started`; torchrun: its
  "Rendezvous'ing worker group" log line) to the last node knowing its rank (`rendezvous.complete`).
  The goal (<= 1.5 s at 64, issue 47) is about this one.
- `entered_s`: from the moment every node has entered its first rendezvous to the last node knowing its
  rank. torchrun logs its line as it enters, after its store client has connected (the c10d handler
  makes its TCPStore before the agent runs), so for torchrun this is `rdzv_s`. petctl's
  `agent.started` comes before its first etcd request: the gRPC channel, the lease, the heartbeat and
  the watches all come after it. Its entry is the first `rendezvous.complete`'s time less that
  rendezvous' own `seconds`. This is the like-for-like figure of the two rendezvous protocols.
- `launch_to_workers_s`: from the first node's launch to the last trivial worker's line: what a user
  waits for, including Python start-up of N processes on this machine (torchrun's agents import torch).
- petctl, as the agents count them (heartbeat refreshes excluded): etcd requests per node to form the
  round (agent start -> `rendezvous.complete`, which carries the counter; mean and max over nodes: the
  closer counts the others' arrivals, so its max grows with N by design) and per node per round over
  the agent's whole life (`status/<node>.etcd_requests`, job end included); both etcd systems:
  requests the etcd server counted per node from launch until every worker ran (heartbeats and status
  included): the v2 store's reads, writes and watches, and the v3 API's gRPC messages received, by
  service (`grpc_server_msg_received_total`: a unary call is one, and so is each keep-alive or watch
  request on a stream; the events a watch sends back are not requests).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from typing import Any

from bench import phases
from bench.petctl_runner import BENCH, PetctlJob
from bench.procs import Node, wait_for
from bench.runmeta import INSTALLED
from bench.scenarios.common import Context
from bench.torchrun_runner import TorchrunJob
from petctl.core.keys import JobKeys
from petctl.core.store import JOB_DEFAULT_BACKEND
from petctl.io.store import open_store

TRIVIAL = BENCH / "trivial_worker.py"
STORES = {"petctl": JOB_DEFAULT_BACKEND, "petctl-v2": "v2"}  # P5's petctl systems and the store each runs on
TORCHRUN_RSS_MB = 260  # a torchrun agent with torch imported: ~230 MB RSS measured here; memory guard
# P5 times the rendezvous alone, so torchrun keeps its default keep-alive (every 5 s, 3 misses), which
# writes its shared state key 5 times less often than the 1 s the failure scenarios use (TUNED_RDZV_CONF).
# At 64 agents on 2 cores torchrun c10d often never ranks with either (bench/README.md, "Set-up").
TORCHRUN_P5_CONF = "last_call_timeout=1,join_timeout=600"


V3_SERVICES = {"etcdserverpb.KV": "v3_kv", "etcdserverpb.Lease": "v3_lease", "etcdserverpb.Watch": "v3_watch"}


def etcd_counts(endpoint: str) -> dict[str, int]:
    """etcd's request counters from its /metrics: the v2 store's (reads, writes, watches) and the v3
    API's gRPC messages received by service (KV, Lease, Watch; other services, such as auth or
    maintenance, under `v3_other`)."""
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=5).read().decode()
    return parse_counts(text)


def parse_counts(text: str) -> dict[str, int]:
    """`etcd_counts` over the text of one /metrics answer (Prometheus' text format)."""
    out = {"reads": 0, "writes": 0, "watches": 0, "v3_kv": 0, "v3_lease": 0, "v3_watch": 0, "v3_other": 0}
    for line in text.splitlines():
        value = int(float(line.rsplit(" ", 1)[1])) if " " in line and not line.startswith("#") else 0
        if line.startswith("etcd_debugging_store_reads_total"):
            out["reads"] += value
        elif line.startswith("etcd_debugging_store_writes_total"):
            out["writes"] += value
        elif line.startswith("etcd_debugging_store_watch_requests_total"):
            out["watches"] += value
        elif line.startswith("grpc_server_msg_received_total{"):
            service = line.split('grpc_service="', 1)[1].split('"', 1)[0] if 'grpc_service="' in line else ""
            out[V3_SERVICES.get(service, "v3_other")] += value
    return out


def _diff(a: dict[str, int], b: dict[str, int], n: int) -> dict[str, float]:
    d = {k: b[k] - a[k] for k in a}
    return {**{k: round(v / n, 2) for k, v in d.items()}, "total": round(sum(d.values()) / n, 2)}


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _failed(nodes: list[Node]) -> str | None:
    bad = [f"{n.name} exited {n.proc.returncode}" for n in nodes if n.proc.poll() not in (None, 0)]
    return ", ".join(bad[:3]) if bad else None


def _all_ran(nodes: list[Node]) -> Any:
    """The time the last worker ran, or "failed: ..." as soon as a node process failed."""
    done = _last(nodes, "worker.trivial")
    if done:
        return done
    bad = _failed(nodes)
    return f"failed: {bad}" if bad else None


def _last(nodes: list[Node], event: str, agg=max) -> float | None:
    times = []
    for n in nodes:
        hits = n.events(event)
        if not hits:
            return None
        times.append(float(hits[0]["ts"]))
    return agg(times)


def _launch_and_time(ctx: Context, job: PetctlJob | TorchrunJob, n: int, out: dict[str, Any], *,
                     timeout: float, up_event: str, server_requests: bool) -> list[Node] | None:
    """Start `n` nodes of `job` and wait until every trivial worker ran, the same way for both systems.

    Fills `out` with `rdzv_s` (from the last `up_event` to the last `rendezvous.complete`),
    `launch_to_workers_s` and, with `server_requests`, the etcd server's requests per node; or with
    `error`. Returns the nodes, or None when not every worker ran. The caller stops the job, even when
    this raises.
    """
    before = etcd_counts(ctx.etcd.endpoint)
    t0 = time.time()
    nodes = [job.start() for _ in range(n)]
    done = wait_for(lambda: _all_ran(nodes), timeout, 0.2)
    after = etcd_counts(ctx.etcd.endpoint)
    if not isinstance(done, float):
        out["error"] = done or f"not every worker ran within {timeout:g} s"
        out["timed_out"] = done is None
        return None
    up = _last(nodes, up_event)
    complete = _last(nodes, "rendezvous.complete")
    entered = _last_entry(nodes) or up
    out["rdzv_s"] = round(complete - up, 4) if up and complete else None
    out["entered_s"] = round(complete - entered, 4) if entered and complete else None
    out["launch_to_workers_s"] = round(done - t0, 4)
    if server_requests:
        out["server_requests_per_node"] = _diff(before, after, n)
    return nodes


def _last_entry(nodes: list[Node]) -> float | None:
    """When the last node entered its first rendezvous: its first `rendezvous.complete`'s time less
    the `seconds` that rendezvous took. None unless every node's event carries `seconds` (torchrun's
    log line does not: its up line is already its entry)."""
    entries = []
    for n in nodes:
        hits = n.events("rendezvous.complete")
        if not hits or "seconds" not in hits[0]:
            return None
        entries.append(float(hits[0]["ts"]) - float(hits[0]["seconds"]))
    return max(entries) if entries else None


def run_petctl(ctx: Context, n: int, rep: int, system: str = "petctl") -> dict[str, Any]:
    """One rep of petctl at N nodes; `system` "petctl-v2" runs the same job on the v2 store (python-etcd,
    the bench's etcd 3.5 serves both APIs), so one run shows both backends side by side."""
    name = f"p5-{n}-{rep}-{int(time.time()) % 100000}"
    job = PetctlJob.create(ctx.dir("P5", system, f"n{n}", f"rep{rep}"), ctx.etcd.endpoint, name,
                           min_size=n, max_size=n, size=n, script=TRIVIAL, initial_wait=300.0,
                           join_timeout=600.0)
    job.spec.etcd_store = STORES[system]
    job.python = ctx.python
    if hasattr(job.spec, "warm_workers"):
        job.spec.warm_workers = False  # a trivial worker needs no torch: don't preload it N times
    out: dict[str, Any] = {"system": system, "n": n, "rep": rep, "store": job.spec.etcd_store}
    try:
        nodes = _launch_and_time(ctx, job, n, out, timeout=ctx.p5_timeout or 300, up_event="agent.started",
                                 server_requests=True)
        if nodes is None:
            return out
        for node in nodes:  # the job ends by itself (every worker exits 0)
            try:
                node.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # job.stop() below kills it; its counters are still read
                out.setdefault("stragglers", []).append(node.name)
        out["agent_requests_per_node_per_round"] = _agent_requests(job, nodes)
        out["rdzv_requests_per_node"] = _rdzv_requests(nodes)
        out["agent_cpu_s"] = agent_cpu(nodes)
        out["worker_cpu_s"] = worker_cpu(nodes)
        return out
    finally:
        job.stop()


def _agent_requests(job: PetctlJob, nodes: list[Node]) -> dict[str, Any]:
    """Mean and max over nodes of the agents' own counters divided by the rounds each one joined."""
    store = open_store(job.endpoint, job.spec.etcd_store)  # type: ignore[arg-type]
    per: list[dict[str, float]] = []
    try:
        leaves = store.list(JobKeys(job.spec.name).status).entries  # none published: nothing to average
    finally:
        store.close()
    rounds = {n.name: max(1, len(n.events("rendezvous.complete"))) for n in nodes}
    for leaf in leaves:
        if not leaf.value:
            continue
        value = json.loads(leaf.value)
        req = value.get("etcd_requests")
        if not req:
            continue
        r = rounds.get(value.get("node_id"), 1)
        per.append({k: req[k] / r for k in ("reads", "writes", "watches")})
    if not per:
        return {}
    out: dict[str, Any] = {"nodes": len(per)}
    for k in ("reads", "writes", "watches"):
        vals = [p[k] for p in per]
        out[k] = {"mean": round(sum(vals) / len(vals), 2), "max": round(max(vals), 2)}
    totals = [sum(p.values()) for p in per]
    out["total"] = {"mean": round(sum(totals) / len(totals), 2), "max": round(max(totals), 2)}
    return out


def agent_cpu(nodes: list[Node]) -> dict[str, Any]:
    """CPU seconds per agent process (its threads, not its workers), as each agent reports its own
    `time.process_time()`: from its launch to ranked (the first `rendezvous.complete`'s `cpu_s`:
    interpreter start-up and imports included, since a new instance pays them), in that rendezvous
    alone (`rdzv_cpu_s`), and over its whole life (`agent.exit`). Mean and max over the agents that
    reported it; {} when none did (an agent older than the figure). `to_started`: to its `agent.started`
    line (start-up and imports); `started_to_ranked`: from there to ranked (set-up, then the rendezvous)."""
    firsts = [hits[0] for n in nodes if (hits := n.events("rendezvous.complete"))]
    starts = [(s[0], r[0]) for n in nodes if (s := n.events("agent.started")) and "cpu_s" in s[0]
              and (r := n.events("rendezvous.complete")) and "cpu_s" in r[0]]
    exits = [hits[-1] for n in nodes if (hits := n.events("agent.exit"))]
    spawns = [float(s[0]["cpu_s"]) - float(r[0]["cpu_s"]) for n in nodes
              if (r := n.events("rendezvous.complete")) and (s := n.events("workers.started"))
              and "cpu_s" in r[0] and "cpu_s" in s[0]]
    out = {"to_ranked": _stats([float(e["cpu_s"]) for e in firsts if "cpu_s" in e]),
           "to_started": _stats([float(s["cpu_s"]) for s, _ in starts]),
           "started_to_ranked": _stats([float(r["cpu_s"]) - float(s["cpu_s"]) for s, r in starts]),
           "rendezvous": _stats([float(e["rdzv_cpu_s"]) for e in firsts if "rdzv_cpu_s" in e]),
           "ranked_to_workers": _stats(spawns),
           "life": _stats([float(e["cpu_s"]) for e in exits if "cpu_s" in e])}
    return {k: v for k, v in out.items() if v is not None}


def worker_cpu(nodes: list[Node]) -> dict[str, Any]:
    """CPU seconds each trivial worker had used when it printed its line (`cpu_s`, its own
    `time.process_time()`: the interpreter's start-up, nearly all of it), mean and max over the nodes;
    {} when none reported it. Why: once a round forms, every ranked node starts its worker while the
    last nodes are still hearing of their rank; on one machine shared by N nodes that start-up is CPU
    the rendezvous waits behind (on hosts of their own it is not), for torchrun as for petctl."""
    values = [float(e["cpu_s"]) for n in nodes if (hits := n.events("worker.trivial"))
              for e in hits[:1] if "cpu_s" in e]
    return _stats(values) or {}


def _stats(values: list[float]) -> dict[str, float] | None:
    """Mean, max and count of per-node CPU seconds; None when no node reported one."""
    return ({"mean": round(sum(values) / len(values), 3), "max": round(max(values), 3), "n": len(values)}
            if values else None)


def _rdzv_requests(nodes: list[Node]) -> dict[str, Any]:
    """Requests each agent made from its start until it knew its rank (the first round), and the keys its
    reads returned meanwhile (`keys_read`: the closer's grow with N, the others' should not)."""
    totals, keys = [], []
    for n in nodes:
        hits = n.events("rendezvous.complete")
        req = hits[0].get("requests") if hits else None
        if isinstance(req, dict):
            totals.append(sum(int(v) for v in req.values()))
        if hits and isinstance(hits[0].get("keys_read"), int):
            keys.append(hits[0]["keys_read"])
    if not totals:
        return {}
    out = {"nodes": len(totals), "mean": round(sum(totals) / len(totals), 2), "max": max(totals)}
    if keys:
        out.update(keys_mean=round(sum(keys) / len(keys), 2), keys_max=max(keys))
    return out


def run_torchrun(ctx: Context, backend: str, n: int, rep: int) -> dict[str, Any]:
    out: dict[str, Any] = {"system": f"torchrun-{backend}", "n": n, "rep": rep}
    need = n * TORCHRUN_RSS_MB
    if mem_available_mb() < need * 1.3:
        out["skipped"] = f"needs ~{need} MB for {n} torchrun agents; {mem_available_mb():.0f} MB available"
        return out
    name = f"p5{backend[:4]}{n}r{rep}{int(time.time()) % 100000}"
    job = TorchrunJob.create(ctx.dir("P5", f"torchrun-{backend}", f"n{n}", f"rep{rep}"), backend, n, n, name,
                             etcd_port=ctx.etcd.client_port, script=TRIVIAL, max_restarts=0,
                             rdzv_conf=TORCHRUN_P5_CONF,
                             python=ctx.python)
    try:
        nodes = _launch_and_time(ctx, job, n, out, timeout=ctx.p5_timeout or 420,
                                 up_event="torchrun.rendezvous_start",
                                 server_requests=backend.startswith("etcd"))  # c10d keeps its store on a node
        if nodes is not None:
            out["worker_cpu_s"] = worker_cpu(nodes)
        return out
    finally:
        job.stop()


def run(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    out: dict[str, Any] = {"title": "rendezvous cost vs N", "sizes": sizes, "runs": {}, "summary": {},
                           "interpreter": INSTALLED if ctx.python != sys.executable else sys.executable}
    # The P1-P3 variants (petctl-spawn, ...) change workers, which P5's trivial worker does not have;
    # petctl-v2 is P5's own: the store.
    for system in (s for s in ctx.systems if s in STORES or not s.startswith("petctl")):
        for n in sizes:
            runs = []
            for rep in range(ctx.reps):
                ctx.log(f"P5 {system} N={n} rep {rep + 1}/{ctx.reps}")
                if system in STORES:
                    r = run_petctl(ctx, n, rep, system)
                else:
                    r = run_torchrun(ctx, system.removeprefix("torchrun-"), n, rep)
                ctx.log(f"P5 {system} N={n}: rdzv {r.get('rdzv_s')} s, launch->workers "
                        f"{r.get('launch_to_workers_s')} s {r.get('error') or r.get('skipped') or ''}")
                runs.append(r)
                if r.get("skipped"):
                    break
                if r.get("timed_out") and rep + 1 < ctx.reps:
                    # A size that did not form once will not form in the next rep either: don't spend
                    # another timeout on it (the error stays in the table's note).
                    ctx.log(f"P5 {system} N={n}: remaining reps skipped after a timeout")
                    break
            key = f"{system}/N={n}"
            out["runs"][key] = runs
            out["summary"][key] = {
                "rdzv_s": phases.summarize([r.get("rdzv_s") for r in runs]),
                "entered_s": phases.summarize([r.get("entered_s") for r in runs]),
                "launch_to_workers_s": phases.summarize([r.get("launch_to_workers_s") for r in runs]),
                "server_requests_per_node": _median_of(runs, "server_requests_per_node", "total"),
                "agent_requests_per_node_per_round": _median_of(runs, "agent_requests_per_node_per_round",
                                                                "total", "mean"),
                "rdzv_requests_per_node": _median_of(runs, "rdzv_requests_per_node", "mean"),
                "rdzv_requests_max_node": _median_of(runs, "rdzv_requests_per_node", "max"),
                "rdzv_keys_per_node": _median_of(runs, "rdzv_requests_per_node", "keys_mean"),
                "rdzv_keys_max_node": _median_of(runs, "rdzv_requests_per_node", "keys_max"),
                "agent_cpu_to_ranked_s": phases.summarize([_dig(r, "agent_cpu_s", "to_ranked", "mean")
                                                           for r in runs]),
                "agent_cpu_to_ranked_max_s": _median_of(runs, "agent_cpu_s", "to_ranked", "max"),
                "agent_cpu_rendezvous_s": _median_of(runs, "agent_cpu_s", "rendezvous", "mean"),
                "agent_cpu_to_started_s": _median_of(runs, "agent_cpu_s", "to_started", "mean"),
                "agent_cpu_started_to_ranked_s": _median_of(runs, "agent_cpu_s", "started_to_ranked", "mean"),
                "agent_cpu_life_s": _median_of(runs, "agent_cpu_s", "life", "mean"),
                "agent_cpu_ranked_to_workers_s": _median_of(runs, "agent_cpu_s", "ranked_to_workers", "mean"),
                "worker_cpu_s": _median_of(runs, "worker_cpu_s", "mean"),
                "skipped": next((r["skipped"] for r in runs if r.get("skipped")), None),
                "errors": [r["error"] for r in runs if r.get("error")],
            }
    return out


def _dig(value: Any, *path: str) -> float | None:
    for p in path:
        value = value.get(p) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def _median_of(runs: list[dict[str, Any]], *path: str) -> float | None:
    vals = [v for r in runs if (v := _dig(r, *path)) is not None]
    return phases.summarize(vals)["median"]
