"""P4 checkpoint overhead: step time with periodic checkpoints of a ~100 MB state to the S3 emulator.

One training process (the workload, world size 1) per variant, all against one moto S3 server:
- `none`: no checkpoints (the baseline),
- `elastic`: petctl.elastic's `Checkpointer` (snapshot on the training thread, serialise + upload in the
  background),
- `sync`: the usual torchrun script: `torch.save` on rank 0 and a blocking upload.
Overhead = mean step time / mean step time of `none` - 1, over every step after a short warm-up (the
checkpoint steps included: that is where the cost is). A step is a real forward/backward of the model on
one thread, padded to BENCH_STEP_TIME, standing in for a GPU step during which the host CPU is idle.
"""

from __future__ import annotations

import time
from typing import Any

from bench import phases
from bench.petctl_runner import node_env
from bench.scenarios.common import Context, interleaved, run_workload
from petctl.io.procs import free_port

VARIANTS = ("none", "elastic", "sync")
WARMUP = 3


class Moto:
    """A moto S3 server on loopback with one bucket."""

    def __init__(self, bucket: str = "petctl-bench") -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.bucket = bucket
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_EC2_METADATA_DISABLED": "true"}

    def __enter__(self) -> Moto:
        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request
        self.server.start()
        import boto3

        boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(
            Bucket=self.bucket)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"state_mb": 10, "steps": 33, "every": 10, "step_time": 0.1}
    return {"state_mb": 100, "steps": 140, "every": 40, "step_time": 0.1}


def run_once(ctx: Context, moto: Moto, variant: str, rep: int, cfg: dict[str, Any]) -> dict[str, Any]:
    env = node_env({**moto.env, "BENCH_STEPS": str(cfg["steps"]), "BENCH_STATE_MB": str(cfg["state_mb"]),
                    "BENCH_CKPT_EVERY": str(cfg["every"]), "BENCH_STEP_TIME": str(cfg["step_time"]),
                    "BENCH_CKPT": variant,
                    "PETCTL_CACHE_DIR": str(ctx.dir("P4", variant, f"rep{rep}", "cache"))})
    if variant != "none":
        env["PETCTL_CHECKPOINT_URL"] = f"s3://{moto.bucket}/p4/{variant}-{rep}-{int(time.time())}"
    out: dict[str, Any] = {"variant": variant, "rep": rep}
    log_path = ctx.dir("P4", variant, f"rep{rep}") / "worker.log"
    node, summary = run_workload(f"p4-{variant}", env, log_path, out, WARMUP)
    if summary is None:
        return out
    out["close_s"] = summary["close_s"]
    saves = node.events("checkpoint.saved")
    out["checkpoints"] = len(saves)
    if saves:
        out["state_bytes"] = int(saves[-1].get("bytes", 0))
        secs = [float(s["seconds"]) for s in saves if "seconds" in s]
        if secs:
            out["save_seconds_median"] = phases.summarize(secs)["median"]
    return out


def run(ctx: Context) -> dict[str, Any]:
    cfg = sizes(ctx.quick)
    out: dict[str, Any] = {"title": "checkpoint overhead", "config": cfg, "runs": {}, "summary": {}}
    with Moto() as moto:
        runs = interleaved(ctx, "P4", VARIANTS, f"{cfg['state_mb']} MB",
                           lambda variant, rep: run_once(ctx, moto, variant, rep, cfg), lambda r: "")
        for variant in VARIANTS:
            out["runs"][variant] = runs[variant]
            out["summary"][variant] = {
                "mean_step_s": phases.summarize([r.get("mean_step_s") for r in runs[variant]]),
                "overhead_pct": phases.summarize([r.get("overhead_pct") for r in runs[variant]]),
                "checkpoints_per_run": phases.summarize([r.get("checkpoints") for r in runs[variant]]),
                "state_bytes": next((r["state_bytes"] for r in runs[variant] if r.get("state_bytes")), None),
                "errors": [r["error"] for r in runs[variant] if r.get("error")],
            }
    return out
