"""What one v3 store call costs its client in CPU, beside another checkout's client in the same run.

    python bench/storecall.py --against /path/to/other/checkout --out bench/results/storecall.json

Why: every agent's rendezvous, heartbeat and peer watch is made of these calls, and the fleet bench runs
many nodes' calls on one loop thread, so their CPU bounds both (bench/README.md). The figure is per call
on the store's loop thread (where the HTTP/2 and gRPC work runs), on the calling thread, and on the
whole process, from /proc's per-thread user and system ticks.

Each measurement is a fresh Python process with one `open_store(endpoint, "v3")` of the tree measured
(PYTHONPATH), against one etcd 3.5 started here. Three loads per process:
- `get`: gets of one key back to back;
- `get_20ms`: gets 20 ms apart, as an agent's calls come (caches grow cold between them);
- `put`: puts of one key back to back (each a raft proposal on etcd's side, which is not billed here).
The trees take turns, rep by rep, so a change in the machine's load falls on both. The result gives the
median over reps of each figure, per tree, and the ratio of this tree's to the other's. Both trees'
commits and dirty flags are in the JSON.

What it leaves out: TLS (the local provider's and AWS's etcd speak it; here it is plain h2c), watches and
keep-alive streams, a store shared by many threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path, like bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import runmeta  # noqa: E402
from bench.petctl_runner import BENCH  # noqa: E402

LOADS = ("get", "get_20ms", "put")
FIGURES = ("loop_ms", "caller_ms", "process_ms")

# Runs in the measured tree's interpreter; prints one JSON line. Uses only what both the store before and
# after petctl/io/store/http2.py have: open_store, and the store's loop thread (`_loop._thread`).
PROBE = r"""
import json, os, sys, time
from petctl.io.store import open_store
tick = os.sysconf("SC_CLK_TCK")
def ticks(tid):
    f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / tick
endpoint, calls = sys.argv[1], int(sys.argv[2])
store = open_store(endpoint, "v3", None, 5.0)
store.put("/storecall/key", "value")
loop = store._loop._thread.native_id
me = __import__("threading").get_native_id()
out = {}
for load, gap in (("get", 0.0), ("get_20ms", 0.02), ("put", 0.0)):
    n = calls if not gap else max(10, calls // 4)
    for _ in range(20):
        store.get("/storecall/key")
    l0, c0, p0 = ticks(loop), ticks(me), time.process_time()
    for _ in range(n):
        if load == "put":
            store.put("/storecall/key", "value")
        else:
            store.get("/storecall/key")
        if gap:
            time.sleep(gap)
    l1, c1, p1 = ticks(loop), ticks(me), time.process_time()
    out[load] = {"loop_ms": (l1 - l0) / n * 1e3, "caller_ms": (c1 - c0) / n * 1e3,
                 "process_ms": (p1 - p0) / n * 1e3, "calls": n}
store.close()
print(json.dumps(out))
"""


def measure(tree: Path, endpoint: str, calls: int) -> dict[str, Any]:
    """One process of `tree`'s client. Raises subprocess.CalledProcessError when it fails."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run([sys.executable, "-c", PROBE, endpoint, str(calls)], env=env, capture_output=True,
                         text=True, timeout=600, check=True, cwd=tree)
    return json.loads(run.stdout.strip().splitlines()[-1])


def summarize(reps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The median over `reps` of every load's figures."""
    return {load: {fig: round(statistics.median(r[load][fig] for r in reps), 4) for fig in FIGURES}
            for load in LOADS}


def table(trees: list[dict[str, Any]]) -> str:
    """Markdown: per load, each tree's medians, and this tree's over the other's."""
    head = "| load | figure, ms per call | " + " | ".join(
        f"{t['name']} ({(t['commit'] or '?')[:7]}{', dirty' if t['dirty'] else ''})" for t in trees)
    rows = [head + (" | ratio |" if len(trees) == 2 else " |"),
            "|---|---|" + "---|" * len(trees) + ("---|" if len(trees) == 2 else "")]
    for load in LOADS:
        for fig in FIGURES:
            values = [t["median"][load][fig] for t in trees]
            ratio = f" {values[0] / values[1]:.2f} |" if len(trees) == 2 and values[1] else ""
            rows.append(f"| {load} | {fig} | " + " | ".join(f"{v:.3f}" for v in values) + " |" + ratio)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another checkout, measured in the same run")
    parser.add_argument("--calls", type=int, default=2000,
                        help="calls per load back to back (a quarter as many 20 ms apart)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(BENCH / "results" / "storecall-latest.json"))
    args = parser.parse_args(argv)
    if args.against is not None and not (args.against / "petctl" / "io" / "store").is_dir():
        parser.error(f"--against {args.against}: not a petctl checkout")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    meta = runmeta.start()
    from petctl.io.etcd import EtcdServer

    trees = [{"name": "this tree", "path": runmeta.REPO, **runmeta.git_state()}]
    if args.against is not None:
        trees.append({"name": "against", "path": args.against.resolve(),
                      **runmeta.git_state(args.against.resolve())})
    scratch = Path(tempfile.mkdtemp(prefix="petctl-storecall-"))
    etcd = EtcdServer.start(scratch / "etcd", log_path=scratch / "etcd.log")
    try:
        for tree in trees:
            tree["reps"] = []
        for rep in range(args.reps):
            for tree in trees:
                tree["reps"].append(measure(tree["path"], etcd.endpoint, args.calls))
                print(json.dumps({"rep": rep, "tree": tree["name"], **tree["reps"][-1]}), flush=True)
    finally:
        etcd.stop(remove_data=True)
        shutil.rmtree(scratch, ignore_errors=True)
    for tree in trees:
        tree["median"] = summarize(tree["reps"])
        tree["path"] = str(tree["path"])
    runmeta.write(meta, Path(args.out), table(trees), title="CPU per v3 store call", trees=trees)
    return 0


if __name__ == "__main__":
    sys.exit(main())
