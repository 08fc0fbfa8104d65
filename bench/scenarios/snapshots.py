"""P8 in-memory snapshot cost: step time with a snapshot of a ~100 MB state at every step, vs none.

One training process (bench/workload.py, world size 1, one torch thread, a real forward/backward padded
to 100 ms: a GPU step, host CPU otherwise idle) per variant, its snapshot directory in /dev/shm as the
agent would give it, no periodic checkpoints (only the snapshot tier is measured):
- `none`: snapshots off (the anchor: the same script, the same Checkpointer),
- `snapshot`: petctl.elastic's defaults: parameters and optimizer state copied in a background thread
  beside the next step (the next `optimizer.step()` held until it is done), K chosen from the cost,
- `sync`: every step, the whole copy at the step end on the training thread (what overlap buys).
Overhead = mean step time / mean step time of `none` (same repetition) - 1, every step after a warm-up:
what a padded step shows (a cost the padding absorbs does not count). The stricter figure, `thread_pct`:
the training thread's time per snapshot (its own work plus the next step held for the copy) / the
step time, as if nothing absorbed it. From each run's `snapshot.stats`: the copy time per 100 MB, those
costs, the checksum, K, and the first snapshot's cost (it maps and faults in the memory) apart.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench import phases
from bench.petctl_runner import node_env
from bench.scenarios.common import Context, interleaved, run_workload

VARIANTS = ("none", "snapshot", "sync")
WARMUP = 5
STATS = ("copy_ms_per_100mb", "copy_ms", "blocked_ms", "cpu_ms", "hook_wait_ms", "crc_ms", "every", "bytes",
         "first_ms")


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"state_mb": 10, "steps": 40, "step_time": 0.1}
    return {"state_mb": 100, "steps": 150, "step_time": 0.1}


def shm_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="petctl-bench-snap-", dir=base))


def run_once(ctx: Context, variant: str, rep: int, cfg: dict[str, Any]) -> dict[str, Any]:
    work = ctx.dir("P8", variant, f"rep{rep}")
    snaps = shm_dir()
    env = node_env({"BENCH_STEPS": str(cfg["steps"]), "BENCH_STATE_MB": str(cfg["state_mb"]),
                    "BENCH_CKPT_EVERY": "0", "BENCH_STEP_TIME": str(cfg["step_time"]),
                    "BENCH_CKPT": "elastic",
                    "BENCH_SNAPSHOT": {"none": "off", "snapshot": "auto", "sync": "sync"}[variant],
                    "PETCTL_CHECKPOINT_URL": (work / "ckpt").as_uri(),
                    "PETCTL_CACHE_DIR": str(work / "cache"), "PETCTL_SNAPSHOT_DIR": str(snaps),
                    "PETCTL_JOB": "bench", "PETCTL_ROUND": "1"})
    out: dict[str, Any] = {"variant": variant, "rep": rep}
    try:
        node, _ = run_workload(f"p8-{variant}", env, work / "worker.log", out, WARMUP)
    finally:
        shutil.rmtree(snaps, ignore_errors=True)
    if "error" in out:
        return out
    stats = node.events("snapshot.stats")
    if stats:
        out.update({k: stats[-1].get(k) for k in STATS})
        out["snapshots"] = stats[-1].get("snapshots")
        thread_ms = (stats[-1].get("blocked_ms") or 0) + (stats[-1].get("hook_wait_ms") or 0)
        out["thread_pct"] = round(100 * thread_ms / (1e3 * out["mean_step_s"]), 3)
    out["every_changes"] = len(node.events("snapshot.every"))
    return out


def run(ctx: Context) -> dict[str, Any]:
    cfg = sizes(ctx.quick)
    out: dict[str, Any] = {"title": "in-memory snapshot cost", "config": cfg, "runs": {}, "summary": {}}
    runs = interleaved(ctx, "P8", VARIANTS, f"{cfg['state_mb']} MB, every step",
                       lambda variant, rep: run_once(ctx, variant, rep, cfg),
                       lambda r: f", blocked {r.get('blocked_ms')} ms, "
                                 f"copy {r.get('copy_ms_per_100mb')} ms/100 MB")
    for variant in VARIANTS:
        out["runs"][variant] = runs[variant]
        out["summary"][variant] = {
            "mean_step_s": phases.summarize([r.get("mean_step_s") for r in runs[variant]]),
            "overhead_pct": phases.summarize([r.get("overhead_pct") for r in runs[variant]]),
            **{k: phases.summarize([r.get(k) for r in runs[variant]]) for k in (*STATS, "thread_pct")},
            "errors": [r["error"] for r in runs[variant] if r.get("error")],
        }
    return out
