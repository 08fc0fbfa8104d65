"""A small CPU DDP training job (gloo) in torchrun style: the example petctl runs.

It reads its place in the world from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so it
runs unchanged under `torchrun --nproc-per-node 2 examples/train_ddp.py` and under petctl. It trains a
small MLP on synthetic data, saves a checkpoint every `--ckpt-every` steps (rank 0, atomically: write a
temporary file, then rename), and resumes from the newest checkpoint when it starts, so a re-formed job
carries on where it left off. Progress is one JSON line per event (petctl's eventlog format):

    {"ts": ..., "event": "train.step", "step": N, "rank": R, "world_size": W, "loss": ...}
    {"ts": ..., "event": "train.resumed", "step": N}          (N = the checkpoint's step)
    {"ts": ..., "event": "checkpoint.saved", "step": N, "url": ...}
    {"ts": ..., "event": "train.done", "step": N}

`step` counts completed optimizer steps, so after resuming from a checkpoint of step N the next
`train.step` line says N + 1.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

CHECKPOINT_FILE = "checkpoint.pt"


def emit(event: str, **fields) -> None:
    print(json.dumps({"ts": time.time(), "event": event, **fields}), flush=True)


def checkpoint_dir(fallback: str) -> Path:
    """$PETCTL_CHECKPOINT_URL (file://...) when petctl runs us, else --ckpt-dir (plain torchrun)."""
    url = os.environ.get("PETCTL_CHECKPOINT_URL", "")
    if not url:
        return Path(fallback)
    u = urlparse(url)
    if u.scheme != "file":
        raise SystemExit(f"train_ddp.py saves to file:// only (got {url}); use petctl.elastic for s3://")
    return Path(unquote(u.path))


# --- checkpointing: the one place petctl.elastic will replace ----------------------------------------
def save_checkpoint(directory: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Atomic: a reader sees the previous checkpoint or this one, never half of one."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / CHECKPOINT_FILE
    tmp = directory / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, final)
    return final


def load_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The step of the checkpoint loaded into model/optimizer, or 0 when there is none yet."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
# ------------------------------------------------------------------------------------------------------


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, different per step and rank, reproducible after a restart."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(size, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)
    return x, y


def main() -> int:
    parser = argparse.ArgumentParser(description="CPU DDP training with checkpoint/resume (torchrun style)")
    parser.add_argument("--steps", type=int, default=200, help="train until this global step")
    parser.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (slows tests)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--ckpt-dir", default="checkpoints", help="used when PETCTL_CHECKPOINT_URL is unset")
    parser.add_argument("--collective-timeout", type=float, default=120.0)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    directory = checkpoint_dir(args.ckpt_dir)
    step = load_checkpoint(directory, model, optimizer)
    # Rank 0's view wins: DDP broadcasts its parameters, and the step counter follows it.
    start = torch.tensor([step])
    dist.broadcast(start, src=0)
    step = int(start.item())
    ddp = DistributedDataParallel(model)
    if step:
        emit("train.resumed", step=step, rank=rank, world_size=world)
    loss_fn = nn.MSELoss()
    while step < args.steps:
        x, y = batch(step, rank, args.batch_size)
        optimizer.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        optimizer.step()
        step += 1
        emit("train.step", step=step, rank=rank, world_size=world, loss=round(loss.item(), 5))
        if rank == 0 and (step % args.ckpt_every == 0 or step == args.steps):
            path = save_checkpoint(directory, step, model, optimizer)
            emit("checkpoint.saved", step=step, rank=rank, url=path.resolve().as_uri())
        if args.step_time:
            time.sleep(args.step_time)
    dist.barrier()  # nobody exits (and looks like a lost peer) while another rank still saves
    if rank == 0:
        emit("train.done", step=step, world_size=world)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
