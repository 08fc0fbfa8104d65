"""What a job at rest costs etcd (issue 47): raft proposals and requests per node per 10 s, from etcd's
own metrics, while N real agents hold a steady round.

A node at rest (its round formed, its workers stepping, no membership change) should cost etcd no raft
proposal: its liveness is a lease keep-alive (answered by the leader, no proposal) and its status is put
only when it changes, its progress every few minutes at most (petctl/agent/reporting.py). This runs N
agents (`python -m petctl.agent.main`, no provider) with `steady_worker.py` (a step line every 0.1 s, no
torch) against an etcd 3.5 of its own, waits until every node is ranked, lets the round settle for
`--settle` seconds (the status backoff's first puts come in the round's first 2.5 minutes), then reads
etcd's /metrics before and after `--window` seconds:

- proposals: `etcd_server_proposals_committed_total` (every write, lease grant and lease revoke is one;
  reads and keep-alives are none);
- requests: the v3 API's gRPC messages received by service (`grpc_server_msg_received_total`: a unary
  call is one, each keep-alive or watch request on a stream is one) and the v2 store's reads, writes and
  watches (bench/scenarios/rendezvous.py's `etcd_counts`);
- etcd's own CPU (`process_cpu_seconds_total`), per node per 10 s: at rest, what grows with the fleet
  on the one etcd host is requests, not proposals. Also above etcd's CPU with no client, read for
  `--idle` seconds before the agents start: at a few nodes, etcd's own ticks are most of its CPU;
- the agents' CPU at rest (`/proc/<pid>/stat`, the agent process alone, not its workers), per node per
  10 s;
- then (`--reform`, on by default) one re-form: the highest rank is SIGKILLed and the others re-form
  without it (the job's min is N - 1): what each survivor's agent spent in CPU from the kill until every
  survivor was ranked again (`/proc`), and in its rendezvous alone (`rdzv_cpu_s` of its
  `rendezvous.complete`), beside the wall time.

    python bench/rest.py --nodes 3 --window 60 --out bench/results/rest-3-v3.json
    python bench/rest.py --nodes 3 --store v2          # the v2 backend: every heartbeat is a proposal
    python bench/rest.py --nodes 64 --timeouts aws     # an AWS job's timeouts: a tenth of the keep-alives

The result records its commit, whether the tree was dirty, the machine and its load (bench/runmeta.py).
tests/bench/test_rest_proposals.py (slow) asserts the v3 figure: at most 1 proposal per node per minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path, like bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import runmeta  # noqa: E402
from bench.petctl_runner import BENCH, PetctlJob  # noqa: E402
from bench.procs import Node, wait_for  # noqa: E402
from bench.scenarios.rendezvous import parse_counts  # noqa: E402
from petctl.core.spec import Timeouts  # noqa: E402
from petctl.core.store import JOB_DEFAULT_BACKEND  # noqa: E402
from petctl.providers.aws.provider import aws_timeouts  # noqa: E402

STEADY = BENCH / "steady_worker.py"
TIMEOUTS = ("local", "aws")  # the agent timeouts a bench's nodes can run with (`timeouts_named`)


def timeouts_named(name: str) -> Timeouts:
    """The agent timeouts `name` names: `local`, the defaults (the local provider's: a keep-alive every
    0.2 s, the peer watch's read every 0.1 s), or `aws`, an AWS job's (`aws_timeouts`: 2 s and 0.8 s).
    Raises ValueError for another name."""
    if name not in TIMEOUTS:
        raise ValueError(f"unknown timeouts {name!r}: choose from {', '.join(TIMEOUTS)}")
    return aws_timeouts() if name == "aws" else Timeouts()


def metrics(endpoint: str) -> tuple[int, dict[str, int], float]:
    """etcd's own counters so far, from one read of its /metrics: committed raft proposals, requests by
    kind (bench/scenarios/rendezvous.py's `parse_counts`), and its process's CPU seconds (user + system,
    the Go runtime's `process_cpu_seconds_total`, in ticks of 0.01 s). Raises OSError when etcd does
    not answer, ValueError when a counter is missing."""
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=5).read().decode()  # noqa: S310
    return int(_value(text, "etcd_server_proposals_committed_total")), parse_counts(text), \
        _value(text, "process_cpu_seconds_total")


def _value(text: str, name: str) -> float:
    """The value of the unlabelled sample `name` in a Prometheus text answer. Raises ValueError when it
    is missing."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if m is None:
        raise ValueError(f"{name} is not in etcd's /metrics")
    return float(m.group(1))


def etcd_window(endpoint: str, nodes: int, window: float) -> dict[str, Any]:
    """What etcd saw over the next `window` seconds, from its /metrics at both ends: raft proposals,
    requests (by kind) and etcd's own CPU, in all and per node per 10 s (proposals per minute too). Used
    by this bench and the fleet bench's window at rest. Why etcd's CPU: a keep-alive or a read is no
    proposal, yet each costs the one etcd host CPU; at rest that is what grows with the fleet. Raises
    OSError when etcd does not answer, ValueError when a counter is missing."""
    (p0, c0, cpu0), w0 = metrics(endpoint), time.monotonic()
    time.sleep(window)
    (p1, c1, cpu1), w1 = metrics(endpoint), time.monotonic()
    span = w1 - w0
    per10 = 10.0 / span / nodes
    requests = {k: c1[k] - c0[k] for k in c0}
    return {"window_s": round(span, 2), "proposals": p1 - p0,
            "proposals_per_node_per_10s": round((p1 - p0) * per10, 3),
            "proposals_per_node_per_min": round((p1 - p0) * per10 * 6, 3),
            "requests": requests,
            "requests_per_node_per_10s": {k: round(v * per10, 2) for k, v in requests.items() if v},
            "requests_total_per_node_per_10s": round(sum(requests.values()) * per10, 2),
            "etcd_cpu_s": round(cpu1 - cpu0, 2),
            "etcd_cpu_per_node_per_10s": round((cpu1 - cpu0) * per10, 5)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (its threads; not its children), from
    `/proc/<pid>/stat`. Raises OSError when the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(endpoint: str, window: float) -> float:
    """etcd's own CPU seconds per 10 s over `window` s with no client: its raft ticks, Go runtime and
    metrics, which every node's share would otherwise carry (at 3 nodes they are most of etcd's CPU).
    Raises as `etcd_window` does."""
    counted = etcd_window(endpoint, 1, window)
    return round(counted["etcd_cpu_s"] * 10.0 / counted["window_s"], 4)


def whole_read_cost(endpoint: str, keys: int, seconds: float, idle_per_10s: float) -> dict[str, Any]:
    """What one read of a `live/` of `keys` heartbeat keys costs etcd: `keys` keys shaped like an
    agent's heartbeat (`NodeRecord`) under a scratch prefix, read whole 20 times a second for `seconds`
    by one client, etcd's CPU above `idle_per_10s` per read and per key. Why: a job at rest reads
    `live/` whole on a budget of 100 reads a second across the fleet past 200 nodes
    (`decisions.safety_period`), so at 1000 nodes that is 100 reads of 1000 keys a second, which no
    3- or 64-node job shows. The keys are deleted after. Raises OSError or ValueError as `etcd_window`
    does, or one of the store's errors."""
    from petctl.core.records import NodeRecord
    from petctl.io.store import open_store

    kv = open_store(endpoint, JOB_DEFAULT_BACKEND, None, 5.0)  # type: ignore[arg-type]
    prefix = "/petctl-bench/whole-read/live/nodes"
    try:
        for i in range(keys):
            record = NodeRecord(node_id=f"i-{i:017x}", host_addr=f"10.42.{i // 250}.{i % 250}", pid=4000 + i)
            kv.put(f"{prefix}/{record.node_id}", record.to_json())
        _, _, cpu0 = metrics(endpoint)
        reads, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            assert len(kv.list(prefix).entries) == keys
            reads += 1
            time.sleep(0.05)
        span = time.monotonic() - t0
        _, _, cpu1 = metrics(endpoint)
    finally:
        kv.delete_dir(prefix)
        kv.close()
    busy = (cpu1 - cpu0) / span - idle_per_10s / 10.0
    per_read = busy / (reads / span)
    return {"keys": keys, "reads": reads, "seconds": round(span, 2), "etcd_cpu_s": round(cpu1 - cpu0, 2),
            "etcd_ms_per_read": round(per_read * 1000, 3), "etcd_us_per_key": round(per_read / keys * 1e6, 3)}


def measure(root: Path, endpoint: str, nodes: int, store: str = JOB_DEFAULT_BACKEND, settle: float = 90.0,
            window: float = 60.0, form_timeout: float = 180.0, reform: bool = False,
            etcd_idle_per_10s: float | None = None, timeouts: str = "local") -> dict[str, Any]:
    """Start `nodes` agents of one job against the etcd at `endpoint`, wait until all are ranked, wait
    `settle` s, and count what etcd saw over `window` s; with `reform`, then kill the highest rank and
    time the survivors' re-form (module docstring). `etcd_idle_per_10s`: etcd's CPU with no client (from
    `idle_cpu`), taken off its CPU in the window before that is shared per node. `timeouts`: the agent
    timeouts by name (`timeouts_named`). Returns the figures
    (per node per 10 s, and the raw counts); the agents are stopped before it returns. Raises
    AssertionError when a round does not form within `form_timeout` s or an agent exits meanwhile."""
    name = f"rest{nodes}{store}{int(time.time()) % 100000}"
    knobs = dataclasses.asdict(timeouts_named(timeouts))
    job = PetctlJob.create(root / name, endpoint, name, min_size=max(1, nodes - 1) if reform else nodes,
                           max_size=nodes, size=nodes, script=STEADY, **{**knobs, "initial_wait": 120.0})
    job.spec.etcd_store = store
    if hasattr(job.spec, "warm_workers"):
        job.spec.warm_workers = False  # the worker imports no torch: nothing to preload
    try:
        started = [job.start() for _ in range(nodes)]
        t0 = time.time()
        wait_for(lambda: job.frozen_ranks(nodes) or any(n.proc.poll() is not None for n in started),
                 form_timeout, 0.5)
        exited = [n.name for n in started if n.proc.poll() is not None]
        assert not exited, f"agents exited before the window: {exited}"
        assert job.frozen_ranks(nodes), f"{nodes} nodes not ranked within {form_timeout:g} s"
        ranked_s = time.time() - t0
        time.sleep(settle)
        pids = [n.proc.pid for n in started]
        cpu0 = sum(cpu_seconds(pid) for pid in pids)
        counted = etcd_window(endpoint, nodes, window)
        cpu1 = sum(cpu_seconds(pid) for pid in pids)
        exited = [n.name for n in started if n.proc.poll() is not None]
        assert not exited, f"agents exited during the window: {exited}"
        ranks = job.frozen_ranks(nodes)
        assert ranks, "the round changed during the window: not at rest"
        out = {"nodes": nodes, "store": store, "timeouts": timeouts, "settle_s": settle,
               "ranked_after_s": round(ranked_s, 2),
               **counted,
               "agent_cpu_per_node_per_10s": round((cpu1 - cpu0) * 10.0 / counted["window_s"] / nodes, 4)}
        if etcd_idle_per_10s is not None:
            busy = counted["etcd_cpu_s"] * 10.0 / counted["window_s"] - etcd_idle_per_10s
            out["etcd_cpu_above_idle_per_node_per_10s"] = round(busy / nodes, 5)
        if reform and nodes > 1:
            out["reform"] = _reform(job, started, ranks, nodes, form_timeout)
        return out
    finally:
        job.stop()


def _reform(job: PetctlJob, started: list[Node], ranks: dict[str, int], nodes: int,
            form_timeout: float) -> dict[str, Any]:
    """SIGKILL the highest rank; the survivors' CPU and wall time until all are ranked again."""
    victim = max(ranks, key=lambda node_id: ranks[node_id])
    survivors = [n for n in started if n.name != victim]
    before = {n.name: cpu_seconds(n.proc.pid) for n in survivors}
    seen = {n.name: len(n.events("rendezvous.complete")) for n in survivors}
    t0 = time.monotonic()
    job.nodes[victim].kill()
    formed = wait_for(lambda: all(len(n.events("rendezvous.complete")) > seen[n.name] for n in survivors),
                      form_timeout, 0.05)
    wall = time.monotonic() - t0
    assert formed, f"the survivors did not re-form within {form_timeout:g} s"
    spent = [cpu_seconds(n.proc.pid) - before[n.name] for n in survivors]
    rdzv = [float(n.events("rendezvous.complete")[-1].get("rdzv_cpu_s", 0.0)) for n in survivors]
    return {"world": nodes - 1, "wall_s": round(wall, 3),
            "cpu_s": {"mean": round(sum(spent) / len(spent), 3), "max": round(max(spent), 3)},
            "rdzv_cpu_s": {"mean": round(sum(rdzv) / len(rdzv), 3), "max": round(max(rdzv), 3)}}


def table(runs: list[dict[str, Any]], etcd_idle_per_10s: float | None = None) -> str:
    rows = ["| nodes | store | timeouts | window | proposals / node / 10 s | per node / min | "
            "requests / node / 10 s (by kind) | etcd CPU s / node / 10 s (above idle) | "
            "agent CPU s / node / 10 s | re-form: wall, agent CPU s (mean, max), in rendezvous |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        kinds = ", ".join(f"{k} {v:g}" for k, v in sorted(r["requests_per_node_per_10s"].items()))
        rows.append(f"| {r['nodes']} | {r['store']} | {r.get('timeouts', 'local')} | {r['window_s']:g} s "
                    f"| {r['proposals_per_node_per_10s']:g} | {r['proposals_per_node_per_min']:g} "
                    f"| {r['requests_total_per_node_per_10s']:g} ({kinds}) "
                    f"| {r.get('etcd_cpu_per_node_per_10s', '-')} "
                    f"({r.get('etcd_cpu_above_idle_per_node_per_10s', '-')}) "
                    f"| {r['agent_cpu_per_node_per_10s']:g} | {_reform_text(r.get('reform'))} |")
    if etcd_idle_per_10s is not None:
        rows.append(f"\netcd with no client: {etcd_idle_per_10s:g} CPU s per 10 s.")
    return "\n".join(rows)


def _reform_text(r: dict[str, Any] | None) -> str:
    if not r:
        return "-"
    return (f"{r['wall_s']:g} s, {r['cpu_s']['mean']:g} / {r['cpu_s']['max']:g}, "
            f"{r['rdzv_cpu_s']['mean']:g} / {r['rdzv_cpu_s']['max']:g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--store", default=JOB_DEFAULT_BACKEND, choices=("v3", "v2"))
    parser.add_argument("--settle", type=float, default=90.0, help="seconds after ranked before the window")
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--no-reform", dest="reform", action="store_false",
                        help="skip the re-form after the window")
    parser.add_argument("--timeouts", default="local", choices=TIMEOUTS,
                        help="the agent timeouts: the defaults, or an AWS job's")
    parser.add_argument("--idle", type=float, default=30.0,
                        help="seconds of etcd's own CPU with no client, read before the agents start")
    parser.add_argument("--read-keys", type=int, default=0,
                        help="first, what etcd spends on a whole read of a live/ of this many keys")
    parser.add_argument("--out", default=str(BENCH / "results" / "rest-latest.json"))
    args = parser.parse_args(argv)
    # SIGTERM (a timeout, a background job's kill) ends the run through the `finally` below: the agents
    # and etcd it started are stopped, not left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    meta = runmeta.start()
    from petctl.io.etcd import EtcdServer

    scratch = Path(tempfile.mkdtemp(prefix="petctl-rest-"))
    etcd = EtcdServer.start(scratch / "etcd", log_path=scratch / "etcd.log")
    runs: list[dict[str, Any]] = []
    whole_read: dict[str, Any] | None = None
    try:
        idle = idle_cpu(etcd.endpoint, args.idle) if args.idle > 0 else None
        if args.read_keys > 0 and idle is not None:
            whole_read = whole_read_cost(etcd.endpoint, args.read_keys, 20.0, idle)
            print(json.dumps({"whole_read": whole_read}), flush=True)
        for _ in range(args.reps):
            runs.append(measure(scratch, etcd.endpoint, args.nodes, args.store, args.settle, args.window,
                                reform=args.reform, etcd_idle_per_10s=idle, timeouts=args.timeouts))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        etcd.stop(remove_data=True)
        shutil.rmtree(scratch, ignore_errors=True)
    text = table(runs, idle)
    if whole_read is not None:
        text += (f"\nOne whole read of {whole_read['keys']} keys: {whole_read['etcd_ms_per_read']:g} ms of "
                 f"etcd CPU ({whole_read['etcd_us_per_key']:g} us a key; {whole_read['reads']} reads).")
    runmeta.write(meta, Path(args.out), text, title="etcd's cost of a job at rest", runs=runs,
                  etcd_idle_cpu_per_10s=idle, whole_read=whole_read)
    return 0


if __name__ == "__main__":
    sys.exit(main())
