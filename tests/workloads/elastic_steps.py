"""A torchrun-style job that uses petctl.elastic: resumable, and saves on a save-now request (a notice).

Prints one JSON line per step (`train.step`) so tests can check that no step was lost or repeated.
Env: STEP_TIME, CKPT_EVERY, STEPS, SETUP_TIME (seconds of set-up before the first step: data loading).
"""

import json
import os
import time

import torch
import torch.distributed as dist

from petctl.elastic import Checkpointer, State

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = State(model=model, optimizer=opt, extra={"step": 0})
ckpt = Checkpointer(keep=3, every=int(os.environ.get("CKPT_EVERY", "20")))
start = ckpt.resume(state)
print(json.dumps({"ts": time.time(), "event": "train.resumed", "step": start, "rank": rank}), flush=True)
time.sleep(float(os.environ.get("SETUP_TIME", "0")))
for step in range(start, int(os.environ.get("STEPS", "1000000"))):
    loss = model(torch.ones(4, 8)).sum()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    state.extra["step"] = step
    print(json.dumps({"ts": time.time(), "event": "train.step", "step": step, "rank": rank,
                      "world_size": world}), flush=True)
    time.sleep(float(os.environ.get("STEP_TIME", "0.1")))
    if ckpt.step_end(step, state):
        break
ckpt.close()
dist.destroy_process_group()
