"""tests/workloads/user_train.py's regression as a user shards it: FSDP2 (`fully_shard`) over gloo, and
`ShardedCheckpointer` + `ShardedState` as docs/elastic.md shows them (no snapshot option: the defaults),
with the same step ledger (rank 0 writes it; see user_train.py for its lines).

The weights after step s are, up to float64 rounding, those of an uninterrupted single-process run at any
world size: each rank trains on its share of a global batch that depends only on the step, and FSDP
averages the ranks' gradients.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from user_train import Ledger, make_model, parse_args, shard  # this script's directory is on sys.path

from petctl.elastic.sharded import ShardedCheckpointer, ShardedState


def main() -> int:
    args = parse_args()
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
        if ledger:  # this rank's shard only: the full weights would take a collective every step
            local = b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())
            ledger.write("step", step=step, digest=hashlib.sha256(local).hexdigest()[:16], loss=loss.item())
        time.sleep(args.step_time)
        if ckpt.step_end(step, app):
            left = True
            if ledger:
                ledger.write("left", step=step)
            break
    ckpt.close()
    full = [v for p in model.parameters() for v in p.full_tensor().detach().flatten().tolist()]
    if ledger and not left:
        ledger.write("done", step=args.steps - 1, weights=full)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
