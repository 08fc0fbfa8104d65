"""A training script written the way README shows petctl.elastic, with nothing tuned to the benchmark.

The benchmark's second workload (`bench/run.py --workload user`): plain top-level imports, argparse,
`init_process_group("gloo")`, `DistributedDataParallel(model)`, and the `State` + `Checkpointer(every=...)`
loop. It prints one JSON line per step (and one after resuming), as examples/train_ddp.py does, which is
what the benchmark reads; it prints nothing about its own start-up, so that part of a recovery is timed
from petctl.elastic's `checkpoint.resumed` event alone. Runs unchanged under petctl and under torchrun.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from petctl.elastic import Checkpointer, State


def log(event, **fields):
    print(json.dumps({"ts": time.time(), "event": event, **fields}), flush=True)


def main():
    parser = argparse.ArgumentParser(description="DDP training with petctl.elastic checkpoints")
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds per step, at least")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    state = State(model=model, optimizer=opt, extra={"step": 0})
    ckpt = Checkpointer(keep=3, every=args.ckpt_every)
    start = ckpt.resume(state)
    log("train.resume", step=start, rank=rank, world_size=world)
    for step in range(start, args.steps):
        t0 = time.time()
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randn(args.batch_size, args.width, generator=g)
        y = x[:, :4].sum(dim=1, keepdim=True)
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        state.extra["step"] = step
        log("train.step", step=step, rank=rank, world_size=world, loss=round(loss.item(), 5))
        if ckpt.step_end(step, state):
            break
        time.sleep(max(0.0, args.step_time - (time.time() - t0)))
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
