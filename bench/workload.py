"""The benchmark's training script: a small DDP (gloo, CPU) model, one JSON line per step.

Runs unchanged under the petctl agent and under torchrun (it only reads torchrun's environment), so both
are measured on the same code. Lines it prints (all `{"ts", "event", ...}`, parsed with eventlog):

    worker.imported   torch is imported (seconds since the process started)
    worker.pg_ready   the gloo process group is up
    worker.setup      model and optimizer built (the first optimizer imports torch._dynamo: seconds)
    train.resume      the step this run starts from (0 on a fresh start) and where it came from
    train.step        one per step: step, rank, world_size, restart
    train.summary     at the end of a run with BENCH_STEPS: timing of the step loop (used by P4)

Environment knobs (all optional):
    BENCH_STEPS       steps to run (default: endless)
    BENCH_STEP_TIME   minimum seconds per step: compute, then sleep the rest (default 0.05)
    BENCH_STATE_MB    model + optimizer state size in MB (default 1)
    BENCH_CKPT        elastic (petctl.elastic, the default), sync (torch.save + upload, blocking) or none
    BENCH_CKPT_EVERY  steps between periodic checkpoints (default 10), or auto (elastic only: Young/Daly)
    BENCH_THREADS     torch intra-op threads (default 1: a node is one core's worth of a small machine)
    BENCH_SNAPSHOT    petctl.elastic's in-memory snapshots: auto (the default: as the agent sets them up),
                      off, or sync (every step, copied at the step end instead of beside the next step)
    PETCTL_CHECKPOINT_URL  file://... or s3://... (no URL: no checkpoints)
"""

from __future__ import annotations

import io
import json
import os
import sys
import time


def _proc_start_time() -> float:
    """Unix time this process was started (from /proc), so the import cost is measured, not guessed."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


T_PROC = _proc_start_time()

import torch  # noqa: E402  (timed on purpose)
import torch.distributed as dist  # noqa: E402


def emit(event: str, **fields) -> None:
    print(json.dumps({"ts": round(time.time(), 6), "event": event, **fields}, separators=(",", ":")),
          flush=True)


def build_model(state_mb: float) -> torch.nn.Module:
    """Linear layers whose weights hold half of `state_mb` (SGD momentum holds the other half)."""
    params = max(1, int(state_mb * 1e6 / 4 / 2))
    layers = 4
    width = max(8, int((params / layers) ** 0.5))
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width, bias=False))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


class SyncCheckpoints:
    """The baseline a torchrun user writes: torch.save on rank 0, upload, blocking the training loop."""

    def __init__(self, url: str, every: int, rank: int) -> None:
        self.url, self.every, self.rank = url.rstrip("/"), every, rank

    def _s3(self):
        import boto3

        return boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
                            region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))

    def save(self, step: int, state: dict) -> None:
        buf = io.BytesIO()
        torch.save({"step": step, "state": state}, buf)
        data = buf.getvalue()
        if self.url.startswith("s3://"):
            bucket, _, prefix = self.url[5:].partition("/")
            self._s3().put_object(Bucket=bucket, Key=f"{prefix}/sync/latest.pt".lstrip("/"), Body=data)
        else:
            path = self.url.removeprefix("file://") + "/sync-latest.pt"
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
        emit("checkpoint.saved", step=step, bytes=len(data), mode="sync")

    def step_end(self, step: int, state_fn) -> bool:
        if self.rank == 0 and (step + 1) % self.every == 0:
            self.save(step, state_fn())
        return False


def main() -> int:
    emit("worker.imported", seconds=round(time.time() - T_PROC, 3), pid=os.getpid())
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    steps = int(os.environ.get("BENCH_STEPS", "0")) or sys.maxsize
    step_time = float(os.environ.get("BENCH_STEP_TIME", "0.05"))
    state_mb = float(os.environ.get("BENCH_STATE_MB", "1"))
    mode = os.environ.get("BENCH_CKPT", "elastic")
    every_raw = os.environ.get("BENCH_CKPT_EVERY", "10")
    every = every_raw if every_raw == "auto" else int(every_raw)  # auto: petctl.elastic picks (issue 28)
    url = os.environ.get("PETCTL_CHECKPOINT_URL", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    distributed = "MASTER_ADDR" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", "0")), 1
    emit("worker.pg_ready", rank=rank, world_size=world)

    torch.manual_seed(0)
    model = build_model(state_mb)
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    width = model[0].in_features
    extra = {"step": -1}
    emit("worker.setup", rank=rank, world_size=world)  # model + optimizer built (imports torch._dynamo)

    ckpt = None
    start = 0
    if url and mode == "elastic":
        from petctl.elastic import Checkpointer, State
        from petctl.elastic.snapshots import SnapshotOptions

        snap = os.environ.get("BENCH_SNAPSHOT", "auto")
        options = {"off": False, "sync": SnapshotOptions(every=1, overlap=False)}.get(snap)
        state = State(model=model, optimizer=opt, extra=extra)
        ckpt = Checkpointer(url=url, keep=2, every=every, snapshots=options)
        start = ckpt.resume(state)
        step_end = lambda s: ckpt.step_end(s, state)  # noqa: E731
    elif url and mode == "sync":
        sync = SyncCheckpoints(url, int(every), rank)
        step_end = lambda s: sync.step_end(s, lambda: {"model": model.state_dict(),  # noqa: E731
                                                         "optimizer": opt.state_dict()})
    else:
        step_end = lambda s: False  # noqa: E731
    emit("train.resume", step=start, rank=rank, world_size=world, restart=restart)

    x = torch.randn(8, width)
    durations: list[float] = []
    t_loop = time.perf_counter()
    step = start
    for step in range(start, steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()
        extra["step"] = step
        emit("train.step", step=step, rank=rank, world_size=world, restart=restart)
        done = step_end(step)
        spent = time.perf_counter() - t0
        if spent < step_time:
            time.sleep(step_time - spent)
        durations.append(time.perf_counter() - t0)
        if done:
            break
    loop_s = time.perf_counter() - t_loop
    if ckpt is not None:
        t_close = time.perf_counter()
        ckpt.close()
        close_s = time.perf_counter() - t_close
    else:
        close_s = 0.0
    if steps != sys.maxsize:
        emit("train.summary", rank=rank, steps=len(durations), loop_s=round(loop_s, 4),
             close_s=round(close_s, 4), durations=[round(d, 5) for d in durations])
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
