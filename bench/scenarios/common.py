"""What every scenario gets: where to write, the shared servers, and the run's size knobs."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.petctl_runner import BENCH, REPO
from bench.procs import Node, start_node


@dataclass
class Context:
    root: Path  # scratch directory of this benchmark run (logs of every node are kept there)
    reps: int
    quick: bool
    etcd: Any  # petctl.io.etcd.EtcdServer
    imds: Any  # petctl.providers.local.metadata_server.LocalMetadataServer (started)
    systems: list[str] = field(default_factory=lambda: ["petctl", "torchrun-c10d", "torchrun-etcd-v2"])
    hang_cap: float = 30.0  # P2: how long torchrun is given before "> cap" is reported
    grace: float = 20.0  # P1: seconds between the notice and the SIGKILL
    sizes: list[int] = field(default_factory=lambda: [8, 32, 64])  # P5 node counts
    p5_timeout: float | None = None  # P5: a rep's wait for every worker; None: each system's default
    timeline: dict[str, Any] = field(default_factory=dict)  # P1/P2 runs kept for the chart
    workloads: list[str] = field(default_factory=lambda: ["bench"])  # P1-P3: "bench", "user", "fsdp", ...
    notice_at: str = "settle"  # P1: "settle" (warm pools full first) or "burst" (random, <= 30 s in)
    seed: int = 0  # P1 burst: the notice delays' seed
    python: str = sys.executable  # the node processes' interpreter (P5: runmeta.installed_python)

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def dir(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path


def interleaved(ctx: Context, sid: str, variants: tuple[str, ...], note: str,
                once: Callable[[str, int], dict[str, Any]], line: Callable[[dict[str, Any]], str]
                ) -> dict[str, list[dict[str, Any]]]:
    """`ctx.reps` runs of every variant, the variants interleaved within each repetition so a drifting
    machine load hits all of them alike; each run's `overhead_pct` is its mean step time against the
    `none` variant's of the same repetition. `line(result)` is what the log says after each run."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(ctx.reps):
        for variant in variants:
            ctx.log(f"{sid} {variant} rep {rep + 1}/{ctx.reps} ({note})")
            r = once(variant, rep)
            ctx.log(f"{sid} {variant}: mean step {r.get('mean_step_s')} s{line(r)} {r.get('error') or ''}")
            runs[variant].append(r)
    base = {r["rep"]: r["mean_step_s"] for r in runs["none"] if "mean_step_s" in r}
    for variant in variants:
        for r in runs[variant]:
            if "mean_step_s" in r and r["rep"] in base:
                r["overhead_pct"] = round(100 * (r["mean_step_s"] / base[r["rep"]] - 1), 3)
    return runs


def run_workload(name: str, env: dict[str, str], log_path: Path, out: dict[str, Any], warmup: int
                 ) -> tuple[Node, dict[str, Any] | None]:
    """Run bench/workload.py once to its end (10 min at most). Sets `out`'s mean and max step time (the
    first `warmup` steps left out), or its `error`; returns the node (its events) and its last
    `train.summary`, None when it failed."""
    node = start_node(name, [sys.executable, "-u", str(BENCH / "workload.py")], log_path, env=env, cwd=REPO)
    try:
        code = node.proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        node.kill()
        out["error"] = "timeout"
        return node, None
    summary = node.events("train.summary")
    if code != 0 or not summary:
        out["error"] = f"workload exit code {code}"
        return node, None
    durations = summary[-1]["durations"][warmup:]
    out["mean_step_s"] = round(sum(durations) / len(durations), 5)
    out["max_step_s"] = round(max(durations), 5)
    return node, summary[-1]
