"""Spot trace replay (issues 28, 43): one trace, replayed under petctl (`every="auto"`) and under torchrun
(c10d, the same workload with `Checkpointer(every=N)`), each on its own fresh job of `trace.nodes` nodes.

The boot is replayed: `--boot B` (simulated seconds) makes each replacement come up B / S replayed
seconds after its launch (S the trace's time scale), billed from the launch, under both systems
(bench/tracefleet.py plays the group). Per system and run: `goodput_scaled` and `goodput_measured`
(bench/traceaccount.py says how), steps lost, re-forms, billed node-seconds, and the bill at the
fixture's spot and on-demand prices (bench/fixtures/prices-*.json, recorded, not live). A run whose
replay fell more than LATE_LIMIT_S behind the trace's schedule is marked invalid and left out of the
mean. The world size and the kept step over time go to the run's PNG (`chart`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from bench import traceaccount as ta
from bench.petctl_runner import BENCH, PetctlJob
from bench.procs import wait_for
from bench.scenarios.common import Context
from bench.torchrun_runner import TorchrunJob
from bench.tracefleet import LATE_LIMIT_S, Fleet, replay
from petctl.agent.notices import save_budget
from petctl.core.spottrace import NOTICE_GRACE, Trace

TRACES = BENCH / "traces"
PRICES = BENCH / "fixtures" / "prices-g5.xlarge-us-east-1.json"
STEP_TIME = 0.2  # 8 nodes on 2 cores: a step any loaded machine keeps
TORCHRUN_EVERY = 1  # torchrun's fixed interval (steps): every step redoes fewest; a 1 MB state saves in ms
# torchrun's --max-restarts in a trace: a worker group that fails (a peer reclaimed mid-step) costs one
# restart, so the 3 the other scenarios give (torchrun's own default is 0) ended the job at its fourth
# loss and the rest of the replay trained nothing.
# A user on spot sets it high.
TORCHRUN_MAX_RESTARTS = 1000
BOOT_S = 90.0  # simulated seconds from an instance's launch to its agent's start (AWS-like; replayed / S)
START_TIMEOUT = 240.0


def find(name: str) -> Path | None:
    """A trace scenario: a shipped trace's name (bench/traces/<name>.json) or a path to one."""
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return path
    shipped = TRACES / f"{name.lower()}.json"
    return shipped if shipped.is_file() else None


def load(path: Path, time_scale: float | None = None) -> Trace:
    """The trace at `path`, replayed at `time_scale` simulated seconds per second where given (a slower
    replay keeps a notice window long enough for a boot plus the agent's own start, which does not
    compress). Raises ValidationError on a malformed trace."""
    trace = Trace.from_json(path.read_text(), str(path))
    return trace if time_scale is None else dataclasses.replace(trace, time_scale=time_scale)


def run(ctx: Context, path: Path, systems: list[str], boot_s: float = BOOT_S,
        torchrun_every: int = TORCHRUN_EVERY, reps: int = 1,
        time_scale: float | None = None) -> dict[str, Any]:
    """The trace at `path` under each system, `reps` times; `time_scale` (S) replaces the trace's own."""
    trace = load(path, time_scale)
    prices = json.loads(PRICES.read_text())
    out: dict[str, Any] = {"trace": trace.name, "file": str(path), "nodes": trace.nodes,
                           "time_scale": trace.time_scale, "replay_s": trace.replay_seconds(),
                           "counts": trace.counts(), "rate_per_node_hour": round(trace.rate(), 3),
                           "boot_s": boot_s, "boot_replayed_s": round(boot_s / trace.time_scale, 3),
                           "late_limit_s": LATE_LIMIT_S, "reps": reps, "prices": prices, "systems": {}}
    for system in [s for s in systems if s in ("petctl", "torchrun-c10d")]:
        runs = []
        for rep in range(reps):
            ctx.log(f"trace {trace.name}: {system}, {trace.nodes} nodes, boot {boot_s:g} s "
                    f"({boot_s / trace.time_scale:g} s replayed), {trace.replay_seconds():.0f}s replay, "
                    f"run {rep + 1}/{reps}")
            runs.append(one(ctx, trace, system, boot_s, torchrun_every, prices, rep))
        out["systems"][system] = {"runs": runs, "summary": summarize(runs)}
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each figure over the valid runs; invalid (late) and failed runs are counted, not
    averaged in."""
    ok = [r for r in runs if "outcome" in r and r.get("valid")]
    keys = ("goodput_scaled", "goodput_measured", "steps_lost", "reforms", "billed_node_s",
            "billed_node_h_scaled")
    mean = {k: round(sum(r["outcome"][k] for r in ok) / len(ok), 4) for k in keys} if ok else {}
    late = sum(1 for r in runs if "outcome" in r and not r.get("valid"))
    return {"valid_runs": len(ok), "invalid_runs": late,
            "failed_runs": sum(1 for r in runs if "outcome" not in r), "mean": mean}


def one(ctx: Context, trace: Trace, system: str, boot_s: float, every: int, prices: dict,
        rep: int = 0) -> dict[str, Any]:
    root = ctx.dir(f"trace-{trace.name}-boot{boot_s:g}", f"{system}-{rep}")
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
        # petctl's agent takes its instance out of the group at a spot notice (its real call, on the
        # metadata endpoint): the group launches the replacement then, and the agent ends its instance
        # after the hand-off.
        fleet = Fleet(system, lambda: job.start(), notices=Path(ctx.imds.notices_dir))
        ctx.imds.on_detach = fleet.request_detach
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
        log = replay(trace, fleet, boot_s / trace.time_scale)
        end = time.time()
    finally:
        for job in jobs:
            job.stop()
        if ctx.imds is not None:
            ctx.imds.on_detach = None
    records = [dict(r, node=name) for name, node in fleet.nodes.items() for r in node.events("train.step")
               if int(r.get("rank", -1)) == 0]
    instances = fleet.instance_events()
    return result(records, instances, log.t0, end, trace.time_scale, prices, log=log,
                  system=system, every=None if system == "petctl" else every,
                  intervals=[r for node in fleet.nodes.values() for r in node.events("checkpoint.interval")])


def result(records: list[dict[str, Any]], instances: list[dict[str, Any]], t0: float, end: float,
           time_scale: float, prices: dict[str, Any], log: Any = None, system: str = "",
           every: int | None = None, intervals: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One run's result from what it recorded: rank 0's train.step records, the fleet's instance events,
    the replay's window [t0, end] and its log (None: a recorded timeline, accounted again)."""
    steps = ta.steps_from(records)
    lives = ta.lives_from_events(instances, end)
    outcome = ta.account(steps, lives, t0, end, time_scale)
    intervals = intervals or []
    valid = log.valid if log is not None else True
    return {"outcome": outcome.__dict__, "valid": valid,
            "invalid_reason": None if valid else
            f"the replay fell {log.max_late_s:.1f} s behind the trace's schedule (limit {LATE_LIMIT_S:g} s)",
            "max_late_s": round(log.max_late_s, 3) if log is not None else None,
            "late": log.late if log is not None else [],
            "cost": ta.cost(outcome, prices["spot_usd_per_hour"], prices["on_demand_usd_per_hour"]),
            "actions": log.actions if log is not None else [],
            "launches": log.launches if log is not None else [],
            "instances": [dict(e, ts=round(e["ts"] - t0, 3)) for e in instances],
            "auto_interval": intervals[-1] if intervals else None, "intervals_chosen": len(intervals),
            "every_steps": every, "window_s": round(end - t0, 3),
            # (seconds, step, world, node, round): enough to account the run again (bench/traceaccount.py)
            "timeline": [(round(s.ts - t0, 2), s.step, s.world, s.node, s.round) for s in steps]}


def reaccount(run: dict[str, Any], time_scale: float, prices: dict[str, Any]) -> dict[str, Any]:
    """A recorded run (its `timeline`, `instances` and `window_s`) accounted again, as `result` would."""
    records = [{"ts": ts, "step": step, "world_size": world, "node": node, "round": rnd}
               for ts, step, world, node, rnd in run["timeline"]]
    again = result(records, run["instances"], 0.0, float(run["window_s"]), time_scale, prices,
                   every=run.get("every_steps"))
    return {**run, "outcome": again["outcome"], "cost": again["cost"]}


def _world(fleet: Fleet) -> int:
    best = 0
    for node in fleet.nodes.values():
        rows = node.events("train.step")
        if rows:
            best = max(best, int(rows[-1].get("world_size", 0)))
    return best


def _shown(system: dict[str, Any]) -> dict[str, Any] | None:
    """The run a chart shows: the first valid one, else the first with a timeline."""
    runs = [r for r in system.get("runs", []) if r.get("timeline")]
    return next((r for r in runs if r.get("valid")), runs[0] if runs else None)


def chart(result: dict[str, Any], path: Path) -> str:
    """World size and kept step over time, per system, of its first valid run (matplotlib, when
    installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no trace chart"
    systems = {k: r for k, v in result["systems"].items() if (r := _shown(v)) is not None}
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
    ax_s.set_xlabel(f"replay seconds (x{result['time_scale']:g} = real time)")
    ax_w.set_title(f"trace {result['trace']}: {result['nodes']} nodes, {result['counts']}, "
                   f"boot {result['boot_s']:g} s")
    ax_w.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"trace chart {path}"


def handoff_note(time_scale: float, boot_s: float, grace_s: float = NOTICE_GRACE) -> str:
    """Why no notice of this replay can hand off to its replacement, or "" where one may.

    The noticed node must end its save `save_budget` seconds into the window (the agent's own rule: a
    window under 60 s keeps a quarter of itself as margin, as a late-seen notice would). The replacement
    must boot before that, and the boot is replayed as `boot_s / time_scale`. Where it cannot, every
    hand-off comes at its deadline. At AWS's real scale that follows from the boot; in a compressed replay
    it may follow from the compression alone, and the figure then understates what petctl gets."""
    window = grace_s / time_scale
    room, booted = save_budget(window, float("inf")), boot_s / time_scale
    if booted < room:
        return ""
    if boot_s >= save_budget(grace_s, float("inf")):
        return (f"a {boot_s:g} s boot is longer than the {grace_s:g} s window leaves for the save: every "
                "hand-off comes at its deadline, as it would on AWS")
    return (f"at x{time_scale:g} the window is {window:g} s and its save must end {room:g} s in, before the "
            f"replayed boot ({booted:g} s): every hand-off comes at its deadline, never at the replacement. "
            "On AWS the replacement could come first; this replay understates petctl (x1.25 replays it)")


def table(result: dict[str, Any]) -> str:
    """The trace's figures per system and run, as Markdown (printed and written beside the JSON). A run
    the replay could not keep on schedule is marked INVALID and left out of the mean."""
    head = ("| system | run | goodput_scaled | goodput_measured | steps lost | re-forms | "
            "billed node-s (replay) | billed node-h (real time) | durable interval | spot $ | "
            "on-demand $ same work | note |")
    lines = [f"trace `{result['trace']}`: {result['nodes']} nodes, {result['counts']}, "
             f"{result['rate_per_node_hour']} losses/node-hour, x{result['time_scale']:g}; boot "
             f"{result['boot_s']:g} s (replayed {result['boot_replayed_s']:g} s); prices: "
             f"{result['prices']['instance_type']} {result['prices']['region']} (recorded fixture)",
             "", head, "|" + "---|" * (head.count("|") - 1)]
    for system, entry in result["systems"].items():
        runs = entry.get("runs", [])
        for i, r in enumerate(runs, 1):
            if "outcome" not in r:
                lines.append(f"| {system} | {i} | error: {r.get('error')} | | | | | | | | | |")
                continue
            o, c = r["outcome"], r["cost"]
            auto = r.get("auto_interval") or {}
            every = r.get("every_steps") or TORCHRUN_EVERY
            interval = (f"auto {auto.get('interval_s')} s ({auto.get('bound') or 'young-daly'})" if auto
                        else f"every {every} steps" if system.startswith("torchrun") else "-")
            note = "" if r.get("valid") else f"INVALID: {r.get('invalid_reason')}"
            lines.append(f"| {system} | {i} | {o['goodput_scaled']:.1%} | {o['goodput_measured']:.1%} | "
                         f"{o['steps_lost']} | {o['reforms']} | {o['billed_node_s']:.0f} | "
                         f"{o['billed_node_h_scaled']:.2f} | {interval} | {c['spot_usd']} | "
                         f"{c['on_demand_same_work_usd']} | {note} |")
        m, summ = entry.get("summary", {}).get("mean"), entry.get("summary", {})
        if len(runs) > 1:
            figures = (f"{m['goodput_scaled']:.1%} | {m['goodput_measured']:.1%} | {m['steps_lost']:g} | "
                       f"{m['reforms']:g} | {m['billed_node_s']:.0f} | {m['billed_node_h_scaled']:.2f} "
                       "| | | | |"
                       if m else "no valid run | | | | | | | | | |")
            lines.append(f"| {system} | mean of {summ.get('valid_runs', 0)} valid | {figures}")
    handoffs = handoff_note(result["time_scale"], result["boot_s"])
    if handoffs:
        lines += ["", f"Hand-offs: {handoffs}."]
    return "\n".join(lines)
