"""Spot trace replay (issue 28): one trace, replayed under petctl (`every="auto"`) and under torchrun (c10d,
the same workload with `Checkpointer(every=N)`), each on its own fresh job of `trace.nodes` nodes.

Per system: goodput (measured on the compressed replay, and simulated at the local boot time and at
AWS-like 90 s and 180 s, labelled as assumptions), steps lost, time re-forming, and the simulated bill at
the fixture's spot and on-demand prices (bench/fixtures/prices-*.json, recorded, not live). The world
size and the kept step over time go to the run's PNG (`chart`). traceaccount.py says how each figure is
computed; bench/tracefleet.py how the trace is played.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench import traceaccount as ta
from bench.petctl_runner import BENCH, PetctlJob
from bench.procs import wait_for
from bench.scenarios.common import Context
from bench.torchrun_runner import TorchrunJob
from bench.tracefleet import Fleet, replay
from petctl.core.spottrace import Trace

TRACES = BENCH / "traces"
PRICES = BENCH / "fixtures" / "prices-g5.xlarge-us-east-1.json"
STEP_TIME = 0.2  # 8 nodes on 2 cores: a step any loaded machine keeps
TORCHRUN_EVERY = 1  # torchrun's fixed interval (steps): best of a sweep over 1, 5 and 20 (bench/README.md)
# torchrun's --max-restarts in a trace: a worker group that fails (a peer reclaimed mid-step) costs one
# restart, so the 3 the other scenarios give (torchrun's own default is 0) ended the job at its fourth
# loss and the rest of the replay trained nothing (the runs before 2026-11-27 19:00 did; bench/README.md).
# A user on spot sets it high.
TORCHRUN_MAX_RESTARTS = 1000
BOOT_S = 3.0  # local boot: launch -> the node's process starts (the local reconciler's replace delay)
AWS_BOOTS = {"aws-90s (assumed)": 90.0, "aws-180s (assumed)": 180.0}
START_TIMEOUT = 240.0


def find(name: str) -> Path | None:
    """A trace scenario: a shipped trace's name (bench/traces/<name>.json) or a path to one."""
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return path
    shipped = TRACES / f"{name.lower()}.json"
    return shipped if shipped.is_file() else None


def run(ctx: Context, path: Path, systems: list[str], boot_s: float = BOOT_S,
        torchrun_every: int = TORCHRUN_EVERY) -> dict[str, Any]:
    trace = Trace.from_json(path.read_text(), str(path))
    prices = json.loads(PRICES.read_text())
    out: dict[str, Any] = {"trace": trace.name, "file": str(path), "nodes": trace.nodes,
                           "time_scale": trace.time_scale, "replay_s": trace.replay_seconds(),
                           "counts": trace.counts(), "rate_per_node_hour": round(trace.rate(), 3),
                           "boot_s": boot_s, "prices": prices, "systems": {}}
    for system in [s for s in systems if s in ("petctl", "torchrun-c10d")]:
        ctx.log(f"trace {trace.name}: {system}, {trace.nodes} nodes, {trace.replay_seconds():.0f}s replay")
        out["systems"][system] = one(ctx, trace, system, boot_s, torchrun_every, prices)
    return out


def one(ctx: Context, trace: Trace, system: str, boot_s: float, every: int, prices: dict) -> dict[str, Any]:
    root = ctx.dir(f"trace-{trace.name}", system)
    ckpt = f"file://{root / 'ckpt'}"
    n, lo = trace.nodes, max(1, trace.nodes // 2)
    env = {"BENCH_STEP_TIME": str(STEP_TIME), "BENCH_THREADS": "1"}
    jobs: list[Any] = []
    if system == "petctl":
        # The prior: the trace's own rate, per replayed hour (the job's clock runs time_scale faster).
        rate = (trace.rate_per_node_hour or trace.rate()) * trace.time_scale
        job = PetctlJob.create(root, ctx.etcd.endpoint, f"tr{int(time.time()) % 100000}", min_size=lo,
                               max_size=n, size=n, checkpoint_url=ckpt, imds=ctx.imds, initial_wait=60.0,
                               env={**env, "BENCH_CKPT_EVERY": "auto", "PETCTL_LOSS_RATE": f"{rate:.4f}"})
        jobs.append(job)
        fleet = Fleet(system, lambda: job.start(), notices=Path(ctx.imds.notices_dir))
    else:
        count = [0]

        def new_job() -> None:
            jobs.append(TorchrunJob.create(root, "c10d", lo, n, f"tr{len(jobs)}-{int(time.time())}",
                                           env={**env, "BENCH_CKPT_EVERY": str(every),
                                                "PETCTL_CHECKPOINT_URL": ckpt},
                                           max_restarts=TORCHRUN_MAX_RESTARTS))
            fleet.protected = None

        def start():
            count[0] += 1
            node = jobs[-1].start(f"t{count[0]}")
            fleet.protected = fleet.protected or node.name  # the c10d store host
            return node

        fleet = Fleet(system, start, notices=None, restart_job=new_job)
        new_job()
    try:
        t_launch = time.time()
        for _ in range(n):
            fleet.launch(t_launch)
        ready = wait_for(lambda: _world(fleet) == n, START_TIMEOUT, interval=0.5)
        if not ready:
            return {"error": f"the job did not reach world {n} within {START_TIMEOUT:.0f}s"}
        log = replay(trace, fleet, boot_s)
        end = time.time()
    finally:
        for job in jobs:
            job.stop()
    steps = [dict(r, node=name) for name, node in fleet.nodes.items() for r in node.events("train.step")
             if int(r.get("rank", -1)) == 0]
    lives = [ta.Life(b.launched, b.ended or end) for b in fleet.billed.values()]
    boots = {f"local-{boot_s:g}s": boot_s, **AWS_BOOTS}
    outcome = ta.account(steps, lives, log.t0, end, trace.time_scale, len(log.launches), boot_s, boots)
    intervals = [r for node in fleet.nodes.values() for r in node.events("checkpoint.interval")]
    return {"outcome": outcome.__dict__, "cost": ta.cost(outcome, prices["spot_usd_per_hour"],
                                                          prices["on_demand_usd_per_hour"]),
            "actions": log.actions, "launches": log.launches,
            "auto_interval": intervals[-1] if intervals else None, "intervals_chosen": len(intervals),
            "every_steps": None if system == "petctl" else every,
            # (seconds, step, world, node, round): enough to account the run again (bench/traceaccount.py)
            "timeline": [(round(float(r["ts"]) - log.t0, 2), int(r["step"]), int(r.get("world_size", 1)),
                          r["node"], r.get("restart", r.get("round", "")))
                         for r in sorted(steps, key=lambda r: float(r["ts"]))]}


def _world(fleet: Fleet) -> int:
    best = 0
    for node in fleet.nodes.values():
        rows = node.events("train.step")
        if rows:
            best = max(best, int(rows[-1].get("world_size", 0)))
    return best


def chart(result: dict[str, Any], path: Path) -> str:
    """World size and kept step over time, per system (matplotlib, when installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no trace chart"
    systems = {k: v for k, v in result["systems"].items() if v.get("timeline")}
    fig, (ax_w, ax_s) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, r in systems.items():
        t = [row[0] for row in r["timeline"]]
        ax_w.step(t, [row[2] for row in r["timeline"]], where="post", label=name)
        ax_s.plot(t, [row[1] for row in r["timeline"]], ".", markersize=2, label=name)
    for r in systems.values():
        for a in r["actions"]:
            if a["what"] != "hold":
                ax_w.axvline(a["at"], color="grey", alpha=0.2, linewidth=0.8)
    ax_w.set_ylabel("world size")
    ax_s.set_ylabel("step (rank 0)")
    ax_s.set_xlabel(f"replay seconds (x{result['time_scale']:g} = simulated)")
    ax_w.set_title(f"trace {result['trace']}: {result['nodes']} nodes, {result['counts']}")
    ax_w.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"trace chart {path}"


def table(result: dict[str, Any]) -> str:
    """The trace's figures per system, as Markdown (printed and written beside the JSON)."""
    head = ("| system | goodput measured (replay) | goodput sim, local boot | sim, 90 s boot (assumed) | "
            "sim, 180 s boot (assumed) | steps lost | re-forming (s) | durable interval | spot $ (180 s) | "
            "on-demand $ same work | saving |")
    lines = [f"trace `{result['trace']}`: {result['nodes']} nodes, {result['counts']}, "
             f"{result['rate_per_node_hour']} losses/node-hour simulated, x{result['time_scale']:g}; "
             f"prices: {result['prices']['instance_type']} {result['prices']['region']} (recorded fixture)",
             "", head, "|" + "---|" * (head.count("|") - 1)]
    for system, r in result["systems"].items():
        if "outcome" not in r:
            lines.append(f"| {system} | error: {r.get('error')} |")
            continue
        o, g = r["outcome"], r["outcome"]["goodput_sim"]
        labels = list(g)
        c = r["cost"][labels[-1]]
        auto = r.get("auto_interval") or {}
        every = r.get("every_steps") or TORCHRUN_EVERY
        interval = (f"auto {auto.get('interval_s')} s ({auto.get('bound') or 'young-daly'})" if auto
                    else f"every {every} steps" if system.startswith("torchrun") else "-")
        lines.append(f"| {system} | {o['goodput_measured']:.1%} | {g[labels[0]]:.1%} | {g[labels[1]]:.1%} | "
                     f"{g[labels[2]]:.1%} | {o['steps_lost']} | {o['reforming_s']} | {interval} | "
                     f"{c['spot_usd']} | {c['on_demand_same_work_usd']} | {c['saving_vs_on_demand']:.0%} |")
    return "\n".join(lines)
