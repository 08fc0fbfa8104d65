"""P4 on the device: `Checkpointer`'s background save of the same states, to a local directory
(file://) and to a loopback S3 emulator (a moto_server process on 127.0.0.1, a free port).

What a save costs the training loop: the staging copy device -> host on the training thread (`save()`
returns once the state is on the host), then the steps that run while the background thread serialises
and uploads, against steps with no save in flight. A save is done when `checkpoint.saved` says so; the
store must then list that step's manifest with the state's bytes. A second save of the same size copies
into the first one's host buffers (`reuse_buffers`, the default), which is what every save but the first
pays.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_step import StepModel, die_with_parent
from petctl.elastic import Checkpointer, State
from petctl.elastic.manifest import readable_manifests
from petctl.io.eventlog import EventLog
from petctl.io.procs import free_port

BASELINE_STEPS = 10
BUCKET = "petctl-gpu-bench"


class MotoServer:
    """moto_server in a process of its own (an in-process emulator would take the training thread's
    GIL), bound to 127.0.0.1 on a free port; stopped (and waited for) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "moto_server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> MotoServer:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                          str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"moto_server did not start on port {self.port} "
                                       f"(see {self.log_path})") from e
                time.sleep(0.1)
        self.client().create_bucket(Bucket=BUCKET)
        return self

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key="testing")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def s3_env(url: str) -> dict[str, str]:
    """What boto3 in this process needs to reach the emulator (set for the S3 runs only)."""
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def run(model: StepModel, url: str, cache_dir: Path, saves: int, deadline: float) -> dict[str, Any]:
    """Background saves of `model`'s state to `url`, one after the other; their figures and the store's
    newest manifest. Another save is started only when the last one's time fits before `deadline` (unix
    time); one not done by then is reported as such (close() still waits for it)."""
    state = State(model=model.model, optimizer=model.optimizer, extra={"step": -1})
    events: list[dict[str, Any]] = []
    log = EventLog("gpu-bench", stream=open(os.devnull, "w"))  # noqa: SIM115
    log.add_sink(events.append)
    ckpt = Checkpointer(url, keep=1, every=0, check_every=0, cache_dir=cache_dir, snapshots=False, log=log)
    out: dict[str, Any] = {"saves": []}
    step = 0
    try:
        baseline = []
        model.step()  # a step whose caches are warm: the baseline is what a save is compared with
        for _ in range(BASELINE_STEPS):
            t0 = time.perf_counter()
            model.step()
            baseline.append(time.perf_counter() - t0)
            step += 1
        base = statistics.mean(baseline)
        out["step_ms_without"] = round(1e3 * base, 3)
        for i in range(saves):
            if i and time.time() + 1.5 * out["saves"][-1]["save_s"] > deadline:
                out["saves_skipped"] = f"{saves - i} save(s): over the time budget"
                break
            t0 = time.perf_counter()
            ckpt.save(step, state)
            stage_s = time.perf_counter() - t0
            saved_step, during = step, []
            while not _done(events, saved_step) and time.time() < deadline:
                t1 = time.perf_counter()
                model.step()
                during.append(time.perf_counter() - t1)
                step += 1
            done = _done(events, saved_step)
            total_s = time.perf_counter() - t0
            saved = next((e for e in events if e["event"] == "checkpoint.saved" and e["step"] == saved_step),
                         None)
            failed = [e.get("error") for e in events if e["event"] == "checkpoint.save_failed"]
            record: dict[str, Any] = {
                "step": saved_step, "stage_s": round(stage_s, 4), "done": done,
                "save_s": round(total_s, 3) if done else None,
                "upload_s": saved["seconds"] if saved else None, "bytes": saved["bytes"] if saved else None,
                "steps_during": len(during), "errors": failed}
            if during:
                mean = statistics.mean(during)
                record["step_ms_during"] = round(1e3 * mean, 3)
                record["overhead_pct_during"] = round(100 * (mean / base - 1), 3)
                # the save's whole cost spread over the steps it spanned (staging included)
                spread = (sum(during) + stage_s) / len(during)
                record["overhead_pct_with_stage"] = round(100 * (spread / base - 1), 3)
            if saved:
                record["stage_ms_per_gb"] = round(1e3 * stage_s / (saved["bytes"] / 1e9), 3)
                record["gb_per_s"] = round(saved["bytes"] / 1e9 / total_s, 3)
            out["saves"].append(record)
            if not done or failed:
                break
    finally:
        ckpt.close()
    newest = next(readable_manifests(ckpt.store, lambda s, r: None), None)
    out["stored_step"] = None if newest is None else newest.step
    out["stored_bytes"] = None if newest is None else newest.total_bytes
    out["verified"] = (newest is not None and bool(out["saves"]) and newest.step == out["saves"][-1]["step"]
                       and newest.total_bytes >= model.state_bytes())
    return out


def _done(events: list[dict[str, Any]], step: int) -> bool:
    return any((e["event"] == "checkpoint.saved" and e.get("step") == step)
               or e["event"] == "checkpoint.save_failed" for e in events)  # a failure names no step
