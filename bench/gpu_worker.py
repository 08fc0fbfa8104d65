"""The worker of bench/gpu.py's warm-start part: a torchrun-style script, world size 1, one JSON line per
milestone on stdout.

    worker.imported   torch imported
    worker.device     the device ready (CUDA: set_device and a first allocation, which makes the context)
    worker.pg_ready   init_process_group done (NCCL on CUDA, with device_id where torch takes it, so the
                      communicator is made here; gloo on CPU)
    worker.step       the first training step done (DDP model built, forward, backward, AdamW, synchronised)
    reform.pg_ready   with BENCH_REFORM_PORT: the group destroyed and made again on that port, as a job
                      that re-forms in place does
    reform.step       a step of a freshly wrapped DDP model in the new group

Environment: BENCH_DEVICE (cuda or cpu), BENCH_REFORM_PORT (optional), and torchrun's (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import inspect
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"ts": round(time.time(), 6), "event": event, **fields}), flush=True)


def init_group(cuda: bool, device: torch.device) -> None:
    kwargs = {}
    if cuda and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = device  # the NCCL communicator made now, not at the first collective
    dist.init_process_group("nccl" if cuda else "gloo", **kwargs)


def train_step(model: torch.nn.Module, cuda: bool, device: torch.device) -> float:
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    loss = ddp(torch.randn(32, 1024, device=device)).square().mean()
    loss.backward()
    opt.step()
    return float(loss.item())  # synchronises


def main() -> None:
    emit("worker.imported")
    cuda = os.environ.get("BENCH_DEVICE", "cpu") == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        torch.empty(1, device=device)
    else:
        device = torch.device("cpu")
    emit("worker.device", cuda=cuda)
    init_group(cuda, device)
    emit("worker.pg_ready", backend=dist.get_backend())
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024)).to(device)
    loss = train_step(model, cuda, device)
    emit("worker.step", loss=loss)
    port = os.environ.get("BENCH_REFORM_PORT")
    if port:
        t0 = time.time()
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = port
        init_group(cuda, device)
        emit("reform.pg_ready", started=round(t0, 6), backend=dist.get_backend())
        loss = train_step(model, cuda, device)
        emit("reform.step", started=round(t0, 6), loss=loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
