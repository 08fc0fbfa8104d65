"""bench/user_train.py with sharded state: the benchmark's `--workload fsdp` (issue 16, sharded snapshots).

The same model, data and loop as user_train.py, written as a user writes FSDP2 with petctl.elastic:
`fully_shard` on the model, `ShardedState` + `ShardedCheckpointer(every=...)`, nothing tuned to the
benchmark. It prints the same JSON line per step, which is what the benchmark reads. A standalone file
(the job's code is this one file), so it repeats user_train.py's argument parsing and loop on purpose.
Runs unchanged under torchrun.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from petctl.elastic import ShardedCheckpointer, ShardedState


def log(event, **fields):
    print(json.dumps({"ts": time.time(), "event": event, **fields}), flush=True)


def main():
    parser = argparse.ArgumentParser(description="FSDP2 training with petctl.elastic sharded checkpoints")
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
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    app = {"app": ShardedState(model, opt, extra={"step": 0})}
    ckpt = ShardedCheckpointer(keep=3, every=args.ckpt_every)
    start = ckpt.resume(app)
    log("train.resume", step=start, rank=rank, world_size=world)
    for step in range(start, args.steps):
        t0 = time.time()
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randn(args.batch_size, args.width, generator=g)
        y = x[:, :4].sum(dim=1, keepdim=True)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        app["app"].extra["step"] = step
        log("train.step", step=step, rank=rank, world_size=world, loss=round(loss.item(), 5))
        if ckpt.step_end(step, app):
            break
        time.sleep(max(0.0, args.step_time - (time.time() - t0)))
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
