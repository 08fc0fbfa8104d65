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
  watches (bench/scenarios/rendezvous.py's `etcd_counts`).

    python bench/rest.py --nodes 3 --window 60 --out bench/results/rest-3-v3.json
    python bench/rest.py --nodes 3 --store v2          # the v2 backend: every heartbeat is a proposal

The result records its commit, whether the tree was dirty, the machine and its load (bench/runmeta.py).
tests/test_rest_proposals.py (slow) asserts the v3 figure: at most 1 proposal per node per minute.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
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
from bench.procs import wait_for  # noqa: E402
from bench.scenarios.rendezvous import etcd_counts  # noqa: E402
from petctl.core.store import JOB_DEFAULT_BACKEND  # noqa: E402

STEADY = BENCH / "steady_worker.py"


def proposals(endpoint: str) -> int:
    """etcd's committed raft proposals so far, from its /metrics. Raises OSError when etcd does not
    answer, ValueError when the counter is missing."""
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=5).read().decode()  # noqa: S310
    m = re.search(r"^etcd_server_proposals_committed_total (\S+)$", text, re.M)
    if m is None:
        raise ValueError("etcd_server_proposals_committed_total is not in etcd's /metrics")
    return int(float(m.group(1)))


def measure(root: Path, endpoint: str, nodes: int, store: str = JOB_DEFAULT_BACKEND, settle: float = 90.0,
            window: float = 60.0, form_timeout: float = 180.0) -> dict[str, Any]:
    """Start `nodes` agents of one job against the etcd at `endpoint`, wait until all are ranked, wait
    `settle` s, and count what etcd saw over `window` s. Returns the figures (per node per 10 s, and the
    raw counts); the agents are stopped before it returns. Raises AssertionError when the round does not
    form within `form_timeout` s or an agent exits meanwhile."""
    name = f"rest{nodes}{store}{int(time.time()) % 100000}"
    job = PetctlJob.create(root / name, endpoint, name, min_size=nodes, max_size=nodes, size=nodes,
                           script=STEADY, initial_wait=120.0)
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
        p0, c0, w0 = proposals(endpoint), etcd_counts(endpoint), time.monotonic()
        time.sleep(window)
        p1, c1, w1 = proposals(endpoint), etcd_counts(endpoint), time.monotonic()
        exited = [n.name for n in started if n.proc.poll() is not None]
        assert not exited, f"agents exited during the window: {exited}"
        assert job.frozen_ranks(nodes), "the round changed during the window: not at rest"
        span = w1 - w0
        per10 = 10.0 / span / nodes
        requests = {k: c1[k] - c0[k] for k in c0}
        return {"nodes": nodes, "store": store, "settle_s": settle, "window_s": round(span, 2),
                "ranked_after_s": round(ranked_s, 2), "proposals": p1 - p0,
                "proposals_per_node_per_10s": round((p1 - p0) * per10, 3),
                "proposals_per_node_per_min": round((p1 - p0) * per10 * 6, 3),
                "requests": requests,
                "requests_per_node_per_10s": {k: round(v * per10, 2) for k, v in requests.items() if v},
                "requests_total_per_node_per_10s": round(sum(requests.values()) * per10, 2)}
    finally:
        job.stop()


def table(runs: list[dict[str, Any]]) -> str:
    rows = ["| nodes | store | window | proposals / node / 10 s | per node / min | requests / node / 10 s "
            "(by kind) |", "|---|---|---|---|---|---|"]
    for r in runs:
        kinds = ", ".join(f"{k} {v:g}" for k, v in sorted(r["requests_per_node_per_10s"].items()))
        rows.append(f"| {r['nodes']} | {r['store']} | {r['window_s']:g} s "
                    f"| {r['proposals_per_node_per_10s']:g} | {r['proposals_per_node_per_min']:g} "
                    f"| {r['requests_total_per_node_per_10s']:g} "
                    f"({kinds}) |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--store", default=JOB_DEFAULT_BACKEND, choices=("v3", "v2"))
    parser.add_argument("--settle", type=float, default=90.0, help="seconds after ranked before the window")
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", default=str(BENCH / "results" / "rest-latest.json"))
    args = parser.parse_args(argv)
    meta = runmeta.start()
    from petctl.io.etcd import EtcdServer

    scratch = Path(tempfile.mkdtemp(prefix="petctl-rest-"))
    etcd = EtcdServer.start(scratch / "etcd", log_path=scratch / "etcd.log")
    runs: list[dict[str, Any]] = []
    try:
        for _ in range(args.reps):
            runs.append(measure(scratch, etcd.endpoint, args.nodes, args.store, args.settle, args.window))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        etcd.stop(remove_data=True)
        shutil.rmtree(scratch, ignore_errors=True)
    doc = {**runmeta.finish(meta), "title": "etcd's cost of a job at rest", "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    text = table(runs)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"load average at the start {meta['machine']['load_avg_start']}, "
          f"at the end {doc['machine']['load_avg_end']}; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
