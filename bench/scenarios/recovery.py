"""P1 announced preemption, P2 silent host loss, P3 scale-up: petctl and torchrun on the same workload.

Three workloads (`--workload`): "bench" (workload.py, which prints its own start-up milestones), "user"
(user_train.py, a script written the way README shows, whose start-up is timed from petctl.elastic's
`checkpoint.resumed` event) and "fsdp" (fsdp_train.py: the same script with FSDP2 and
`ShardedCheckpointer`, so P2 measures sharded snapshots). Results are stored under "<sid>-user" and
"<sid>-fsdp".

Each repetition starts a fresh 3-node job (1 worker per node), lets it train past a checkpoint, disrupts
it, and times the survivors (or the grown job) until they run a training step at the new world size.
The removed node is petctl's highest rank and torchrun's last-started node (never the c10d store host).

Systems: "petctl", "torchrun-c10d", "torchrun-etcd-v2", and "petctl-nosnap": petctl with its in-memory
snapshots switched off (PETCTL_SNAPSHOTS=0), the anchor P2's lost steps are compared with (issue 16).
"""

from __future__ import annotations

import random
import signal
import time
from typing import Any

from bench import phases
from bench.petctl_runner import BENCH, PetctlJob
from bench.procs import Node, wait_for
from bench.scenarios.common import Context
from bench.torchrun_runner import TorchrunJob

WARM_STEPS = 25  # steps every node runs before the disruption (checkpoints every 10: 9 and 19 exist)
WARM_SETTLE = 30.0  # petctl: longest wait for the agents' warm pools to be refilled before a disruption
CKPT_EVERY = 10
STEP_TIME = 0.05
START_TIMEOUT = 120.0
FRAMEWORK_START_TIMEOUT = 300.0  # hf, lightning: 3 framework workers' imports and set-up on a busy host
RECOVER_TIMEOUT = 90.0

SCENARIOS = {
    "P1": {"title": "announced preemption", "nodes": 3, "min": 2, "max": 3, "world_after": 2},
    "P2": {"title": "silent host loss (SIGSTOP)", "nodes": 3, "min": 2, "max": 3, "world_after": 2},
    "P3": {"title": "scale-up 3 -> 4", "nodes": 3, "min": 3, "max": 4, "world_after": 4},
}


# The petctl agents a scenario can run: its defaults, and (P2) the TTL-only detection as it was before
# issue 16 (1 s refreshes, 3 s TTL; with those the peer watch is off, agent/liveness.py), beside it.
PETCTL_VARIANTS: dict[str, dict[str, float]] = {
    "petctl": {}, "petctl-ttl3": {"heartbeat_interval": 1.0, "heartbeat_ttl": 3.0},
    "petctl-nosnap": {},  # snapshots off: its env (workload_env) sets PETCTL_SNAPSHOTS=0
    "petctl-spare": {},  # a spare warm worker per slot: its env sets PETCTL_WARM_SPARES=1
    "petctl-spawn": {}}  # warm workers spawned, each importing, not forked: its env sets PETCTL_WARM_FORK=0
BASELINES = {"P2": ["petctl-ttl3"]}  # run after petctl whenever petctl runs this scenario


def systems_for(sid: str, systems: list[str]) -> list[str]:
    """The systems a scenario runs: the ones asked for, plus its petctl baselines when petctl is asked."""
    extra = [b for b in BASELINES.get(sid, []) if "petctl" in systems and b not in systems]
    out = [s for s in systems if s in PETCTL_VARIANTS or s.startswith("torchrun-")]
    at = out.index("petctl") + 1 if "petctl" in out else len(out)
    return out[:at] + extra + out[at:]


# Workload name -> its script. user_train.py's defaults are the bench's (a checkpoint every 10 steps, at
# least 50 ms per step): it runs with no arguments, as a user would start it.
WORKLOADS = {"bench": BENCH / "workload.py", "user": BENCH / "user_train.py",
             "fsdp": BENCH / "fsdp_train.py",  # the user's script with FSDP2 and ShardedCheckpointer
             "hf": BENCH / "hf_train.py", "lightning": BENCH / "lightning_train.py"}  # the framework examples
BURST_WINDOW = 30.0  # P1 --notice-at burst: the notice comes at uniform(0, this) s after the round formed


def workload_env(system: str = "petctl") -> dict[str, str]:
    env = {"BENCH_STEP_TIME": str(STEP_TIME), "BENCH_CKPT_EVERY": str(CKPT_EVERY), "BENCH_STATE_MB": "1",
           "BENCH_CKPT": "elastic"}
    if system == "petctl-nosnap":
        env["PETCTL_SNAPSHOTS"] = "0"
    if system == "petctl-spare":
        env["PETCTL_WARM_SPARES"] = "1"
    if system == "petctl-spawn":
        env["PETCTL_WARM_FORK"] = "0"
    return env


def result_key(sid: str, workload: str, notice_at: str = "settle") -> str:
    """Where a scenario's results live in the JSON: "P1" for the bench workload, "P1-user" for the user's,
    "P1-user-burst" for notices close together."""
    key = sid if workload == "bench" else f"{sid}-{workload}"
    return f"{key}-burst" if notice_at == "burst" and sid == "P1" else key


def _formed_at(nodes: list[Node], world: int) -> float:
    """When the round at `world` began training: its first step on any node."""
    return min(float(e["ts"]) for n in nodes for e in n.events("train.step")
               if int(e.get("world_size", 0)) == world)


def _trained(nodes: list[Node], world: int, steps: int) -> bool:
    for node in nodes:
        hits = [e for e in node.events("train.step") if int(e.get("world_size", 0)) == world]
        if not hits or int(hits[-1]["step"]) < steps:
            return False
    return True


def _start_job(ctx: Context, system: str, sid: str, rep: int, sc: dict[str, Any], workload: str):
    key = result_key(sid, workload, ctx.notice_at)
    name = f"{key.lower()}-{system.split('-')[-1]}-{rep}-{int(time.time()) % 100000}"
    root = ctx.dir(key, system, f"rep{rep}")
    ckpt = f"file://{ctx.dir(key, system, f'rep{rep}', 'checkpoints')}"
    script = WORKLOADS[workload]
    if system in PETCTL_VARIANTS:
        job = PetctlJob.create(root, ctx.etcd.endpoint, name, min_size=sc["min"], max_size=sc["max"],
                               size=sc["nodes"], env=workload_env(system), checkpoint_url=ckpt, imds=ctx.imds,
                               script=script, initial_wait=60.0, **PETCTL_VARIANTS[system])
        nodes = [job.start() for _ in range(sc["nodes"])]
    else:
        backend = system.removeprefix("torchrun-")
        job = TorchrunJob.create(root, backend, sc["min"], sc["max"], name, etcd_port=ctx.etcd.client_port,
                                 env={**workload_env(), "PETCTL_CHECKPOINT_URL": ckpt}, script=script)
        nodes = []
        for _ in range(sc["nodes"]):
            nodes.append(job.start())
            time.sleep(0.3)  # the first one binds the c10d store port
    return job, nodes


def _victim(job: Any, system: str, nodes: list[Node], world: int) -> Node:
    if system in PETCTL_VARIANTS:
        ranks = wait_for(lambda: job.frozen_ranks(world), 10) or {}
        top = max(ranks, key=ranks.get) if ranks else nodes[-1].name
        return job.nodes[top]
    return nodes[-1]


def run_once(ctx: Context, sid: str, system: str, rep: int, workload: str = "bench") -> dict[str, Any]:
    sc = SCENARIOS[sid]
    job, nodes = _start_job(ctx, system, sid, rep, sc, workload)
    result: dict[str, Any] = {"system": system, "rep": rep, "workload": workload}
    try:
        start_cap = FRAMEWORK_START_TIMEOUT if workload in ("hf", "lightning") else START_TIMEOUT
        if not wait_for(lambda: _trained(nodes, sc["nodes"], WARM_STEPS), start_cap, 0.2):
            result["error"] = f"job did not reach step {WARM_STEPS} at world {sc['nodes']}"
            return result
        if ctx.notice_at == "burst" and sid == "P1":
            # The second notice of a burst: at a random time in the first 30 s of the round, whatever the
            # warm pools' state (seeded: the same delays for every system).
            delay = random.Random(f"{ctx.seed}-{rep}").uniform(0.0, BURST_WINDOW)
            formed = _formed_at(nodes, sc["nodes"])
            time.sleep(max(0.0, formed + delay - time.time()))
            result["notice_after_round_s"] = round(time.time() - formed, 2)
        elif system in PETCTL_VARIANTS:
            # Steady state: every agent has refilled its warm pool for the next restart (a real job runs
            # for minutes between disruptions; 25 steps here are 2-3 s). Capped, and recorded.
            t_settle = time.time()
            settled = wait_for(lambda: all(len(n.events("workers.warm_ready")) >= 2 for n in nodes),
                               WARM_SETTLE, 0.2)
            result["settle_s"] = round(time.time() - t_settle, 2)
            result["warm_settled"] = bool(settled)
        world = sc["world_after"]
        cap = ctx.hang_cap if (sid == "P2" and system not in PETCTL_VARIANTS) else RECOVER_TIMEOUT
        kill_at: float | None = None
        victim: Node | None = None
        if sid == "P3":
            t_event = time.time()
            newcomer = job.start()
            watch = [*nodes, newcomer]
            detect_nodes = watch
        else:
            victim = _victim(job, system, nodes, sc["nodes"])
            watch = [n for n in nodes if n is not victim]
            detect_nodes = nodes
            if sid == "P1":
                if system in PETCTL_VARIANTS:
                    # petctl trains on after a spot notice until its hand-off (no replacement comes in
                    # this harness: at the last moment that leaves time to save). The stall is timed from
                    # the hand-off, where training stops for the change, as torchrun's is from its SIGTERM.
                    t_notice = job.notice(victim.name, ctx.grace)
                    handoff = wait_for(lambda: victim.events("preemption.handoff"), ctx.grace, 0.05)
                    t_event = float(handoff[0]["ts"]) if handoff else time.time()
                    result["notice_to_handoff_s"] = round(t_event - t_notice, 3)
                    kill_at = t_notice + ctx.grace
                else:  # torchrun has no notice: it gets SIGTERM at the notice time
                    t_event = time.time()
                    victim.proc.send_signal(signal.SIGTERM)
                    kill_at = t_event + ctx.grace
            else:
                t_event = time.time()
                victim.signal(signal.SIGSTOP)

        def recovered() -> float | None:
            nonlocal kill_at
            if kill_at is not None and time.time() >= kill_at and victim is not None:
                victim.kill()  # the instance is reclaimed at the announced time
                kill_at = None
            return phases.recovered_at(watch, world, t_event)

        t_ok = wait_for(recovered, cap, 0.1)
        time.sleep(0.5)  # let a few more lines land in the logs
        if t_ok is None:
            result["capped"] = cap
            result["seconds"] = None
        else:
            result["seconds"] = round(t_ok - t_event, 4)
        if sid in ("P1", "P2", "P3"):
            result["steps_lost"] = phases.steps_lost(watch, world, t_event)
        if sid == "P3":  # the old members' pause: the newcomer must not make them wait for its start-up
            result["stall"] = phases.stall(nodes, world, t_event)
        marks = phases.milestones(watch, world, t_event, detect_nodes=detect_nodes)
        result["milestones"] = marks
        result["phases"] = phases.phase_durations(marks)
        result["sub_phases"] = phases.sub_phases(marks)
        if sid == "P2":  # detection: the first survivor's, and when every survivor knew
            result["detect_s"] = marks.get("detect")
            result["all_know_s"] = phases.all_know(watch, t_event)
        if sid in ("P1", "P2"):
            _keep_timeline(ctx, result_key(sid, workload, ctx.notice_at), system, rep, nodes, t_event, result)
        return result
    finally:
        job.stop()


def _keep_timeline(ctx: Context, sid: str, system: str, rep: int, nodes: list[Node], t_event: float,
                   result: dict[str, Any]) -> None:
    """The steps of each node around the event, for the chart (first repetition only)."""
    key = f"{sid}/{system}"
    if rep != 0 or key in ctx.timeline:
        return
    series = {}
    for node in nodes:
        pts = [(round(float(e["ts"]) - t_event, 3), int(e["step"]), int(e.get("world_size", 0)))
               for e in node.events("train.step") if float(e["ts"]) >= t_event - 3]
        series[node.name] = pts
    ctx.timeline[key] = {"t_event": t_event, "series": series, "milestones": result.get("milestones", {}),
                         "seconds": result.get("seconds"), "capped": result.get("capped")}


def run(ctx: Context, sid: str, workload: str = "bench") -> dict[str, Any]:
    sc = SCENARIOS[sid]
    out: dict[str, Any] = {"title": sc["title"], "workload": workload, "runs": {}}
    for system in systems_for(sid, ctx.systems):
        runs = []
        for rep in range(ctx.reps):
            ctx.log(f"{sid} ({workload}) {system} rep {rep + 1}/{ctx.reps}")
            r = run_once(ctx, sid, system, rep, workload)
            ctx.log(f"{sid} ({workload}) {system} rep {rep + 1}: {r.get('seconds')} s "
                    f"(lost {r.get('steps_lost')}, capped {r.get('capped')}, error {r.get('error')})")
            runs.append(r)
        out["runs"][system] = runs
        out.setdefault("summary", {})[system] = summarize_runs(runs)
    return out


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    secs = [r.get("seconds") for r in runs]
    capped = [r["capped"] for r in runs if r.get("capped")]
    out: dict[str, Any] = {"seconds": phases.summarize(secs), "capped_runs": len(capped),
                           "cap": max(capped) if capped else None,
                           "errors": [r["error"] for r in runs if r.get("error")]}
    lost = [r.get("steps_lost") for r in runs if r.get("steps_lost") is not None]
    if lost:
        out["steps_lost"] = phases.summarize(lost)
    for key in ("detect_s", "all_know_s"):
        if any(key in r for r in runs):
            out[key] = phases.summarize([r.get(key) for r in runs])
    stalls = [r.get("stall") for r in runs if r.get("stall") is not None]
    if stalls:
        out["stall"] = phases.summarize(stalls)
    names = {k for r in runs for k in r.get("phases", {})}
    out["phases_median"] = {k: phases.summarize([r.get("phases", {}).get(k) for r in runs])["median"]
                            for k in phases.PHASES if k in names}
    sub = {k for r in runs for k in r.get("sub_phases", {})}
    out["sub_phases_median"] = {
        label: phases.summarize([r.get("sub_phases", {}).get(label) for r in runs])["median"]
        for label, _n, _a in phases.MILESTONES if label in sub}
    return out
