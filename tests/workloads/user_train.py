"""A training script as a user writes it from README.md's petctl.elastic snippet, plus a step ledger.

Nothing in it is tuned to petctl's tests: argparse, gloo, plain DDP over a small float64 MLP, a learning
rate schedule, the `State` + `Checkpointer(every=20)` loop exactly as README shows it. Each rank trains on
its shard of a global batch that depends only on the step (a DistributedSampler does the same), so the
weights after step s are, up to float64 rounding, those of an uninterrupted single-process run at any
world size (global batch divisible by the world size).

The one addition is the ledger a test reads: rank 0 appends one JSON line per completed step to
`$LEDGER_DIR/ledger.jsonl` (a step computed twice, in two rounds, is lost work):

    {"event": "resumed", "start": S, ...}                   where this round's rank 0 started
    {"event": "step", "step": s, "digest": D, ...}          step s done; D: sha256 of the weights after it
    {"event": "left", "step": s, ...}                       step_end returned True: a save-and-leave at s
    {"event": "done", "step": s, "weights": [...], ...}     the last step done; the final weights

each with `ts`, `round` ($PETCTL_ROUND), `world` and `node` ($PETCTL_NODE_ID). Without $LEDGER_DIR it
writes no ledger. `--step-time` pads each step until the test ends the padding (tests/workloads/padding.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from petctl.elastic import Checkpointer, State
from tests.workloads.padding import pad


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="a small DDP regression, checkpointed with petctl.elastic")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of 'data loading' per step")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (`fully_shard`) and "
                        "checkpoint with ShardedCheckpointer + ShardedState (docs/elastic.md)")
    return parser.parse_args()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def shard(step: int, rank: int, world: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch (the same global batch at any world size)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, 8, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x[rank::world], y[rank::world]


def weights(model: nn.Module) -> list[float]:
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


class Ledger:
    """Rank 0's record of its completed steps (one line per write, appended: several rounds share it)."""

    def __init__(self, world: int) -> None:
        directory = os.environ.get("LEDGER_DIR")
        self.f = open(os.path.join(directory, "ledger.jsonl"), "a", buffering=1) if directory else None  # noqa: SIM115
        self.base = {"round": int(os.environ.get("PETCTL_ROUND", "0")), "world": world,
                     "node": os.environ.get("PETCTL_NODE_ID", socket.gethostname())}

    def write(self, event: str, **fields) -> None:
        if self.f is not None:
            self.f.write(json.dumps({"ts": time.time(), "event": event, **self.base, **fields}) + "\n")


def main() -> int:
    args = parse_args()
    if args.fsdp:
        return main_fsdp(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {world} ranks")
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    ledger = Ledger(world) if rank == 0 else None

    state = State(model=ddp, optimizer=opt, scheduler=sched, extra={"step": 0})
    ckpt = Checkpointer(keep=3, every=args.ckpt_every)
    start = ckpt.resume(state)
    if ledger:
        ledger.write("resumed", start=start)
    left = False
    for step in range(start, args.steps):
        x, y = shard(step, rank, world, args.global_batch)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        state.extra["step"] = step
        if ledger:
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
            ledger.write("step", step=step, digest=digest.hexdigest()[:16], loss=loss.item())
        pad(args.step_time)
        if ckpt.step_end(step, state):
            left = True
            if ledger:
                ledger.write("left", step=step)
            break
    ckpt.close()
    if ledger and not left:
        ledger.write("done", step=args.steps - 1, weights=weights(model))
    dist.destroy_process_group()
    return 0


def main_fsdp(args: argparse.Namespace) -> int:
    """The same regression, sharded: FSDP averages the ranks' gradients as DDP does, so the weights after
    step s are again those of an uninterrupted single-process run, up to float64 rounding. No scheduler
    (`ShardedState` holds a model, an optimizer and extras)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from petctl.elastic import ShardedCheckpointer, ShardedState

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {world} ranks")
    model = make_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ledger = Ledger(world) if rank == 0 else None
    app = {"app": ShardedState(model, opt, extra={"step": 0})}
    ckpt = ShardedCheckpointer(keep=3, every=args.ckpt_every)
    start = ckpt.resume(app)
    if ledger:
        ledger.write("resumed", start=start)
    left = False
    for step in range(start, args.steps):
        x, y = shard(step, rank, world, args.global_batch)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        app["app"].extra["step"] = step
        if ledger:  # this rank's shard: the full weights would take a collective at every step
            local = b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())
            ledger.write("step", step=step, digest=hashlib.sha256(local).hexdigest()[:16], loss=loss.item())
        pad(args.step_time)
        if ckpt.step_end(step, app):
            left = True
            if ledger:
                ledger.write("left", step=step)
            break
    ckpt.close()
    full = [v for p in model.parameters() for v in p.full_tensor().detach().flatten().tolist()]  # collective
    if ledger and not left:
        ledger.write("done", step=args.steps - 1, weights=full)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
