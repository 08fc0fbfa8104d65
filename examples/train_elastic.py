"""A DDP job written with petctl.elastic: resumable in one call, every sample read once, a fixed global batch.

    petctl run_job --min 2 --max 4 examples/train_elastic.py -- --steps 300 --global-batch 96

It runs unchanged under plain torchrun too. What petctl.elastic gives it:
- `Checkpointer` saves in the background, resumes from the newest checkpoint (or from a node's memory
  after a node is lost without warning), and saves the same step on every rank at a spot notice or a
  planned scale change;
- `ElasticSampler` keeps one data cursor for the job: when the world changes size mid-epoch, no sample
  is read twice or skipped;
- `--global-batch G` keeps G samples a step at any world size: each rank reads G / W, in micro-batches
  of at most `--micro-batch`, and accumulates their gradients (`sampler.plan` says how many).

Progress is one JSON line per event, as petctl's eventlog writes them (`petctl status` reads `train.step`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from petctl.elastic import Checkpointer, ElasticSampler, State, endless


def emit(event: str, **fields) -> None:
    print(json.dumps({"ts": time.time(), "event": event, **fields}), flush=True)


def synthetic(size: int) -> TensorDataset:
    """A regression dataset, the same in every process (sample i is row i)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, 16, generator=g)
    return TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=96, help="samples a step, at any world size")
    parser.add_argument("--micro-batch", type=int, default=32, help="at most this many a forward pass")
    parser.add_argument("--samples", type=int, default=4096, help="the dataset's size")
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds a step (slows it down)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = synthetic(args.samples)
    sampler = ElasticSampler(data, global_batch=args.global_batch, micro_batch=args.micro_batch)
    plan = sampler.plan  # this round's share: plan.accumulation micro-batches of plan.micro_batch
    loader = DataLoader(data, batch_size=plan.micro_batch, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = State(model=model, optimizer=optimizer, stateful={"sampler": sampler})
    ckpt = Checkpointer(keep=3, every=args.ckpt_every)  # $PETCTL_CHECKPOINT_URL
    start = ckpt.resume(state)  # before the loader's first pass: it starts at the kept step's cursor
    ddp = DistributedDataParallel(model)
    emit("train.resumed", step=start, rank=rank, world_size=world, epoch=sampler.epoch,
         micro_batch=plan.micro_batch, accumulation=plan.accumulation)

    batches = endless(loader)
    for step in range(start, args.steps):
        optimizer.zero_grad()
        for i in range(plan.accumulation):
            x, y = next(batches)
            last = i == plan.accumulation - 1
            with contextlib.nullcontext() if last else ddp.no_sync():  # all-reduce once, on the last
                loss = nn.functional.mse_loss(ddp(x), y) / plan.accumulation
                loss.backward()
        optimizer.step()
        emit("train.step", step=step + 1, rank=rank, world_size=world, loss=round(loss.item(), 5))
        if args.step_time:
            time.sleep(args.step_time)
        if ckpt.step_end(step, state):  # moves the data cursor, then saves; True at a notice: leave
            break
    else:
        if rank == 0:
            emit("train.done", step=args.steps, world_size=world, epoch=sampler.epoch,
                 offset=sampler.cursor.offset)
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
