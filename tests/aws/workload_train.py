"""A tiny DDP training job for the AWS end-to-end test: gloo, a linear model, checkpoints to the job's
S3 prefix through petctl.elastic ($PETCTL_CHECKPOINT_URL is s3://...; boto3 reaches the emulator through
AWS_ENDPOINT_URL). One JSON line per step, in petctl's event format."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from petctl.elastic import Checkpointer, State

STEPS = int(os.environ.get("STEPS", "6"))
STEP_TIME = float(os.environ.get("STEP_TIME", "0"))

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
state = State(model=model, optimizer=optimizer, extra={"step": -1})
ckpt = Checkpointer(keep=2, every=2, background=False)
start = ckpt.resume(state)
if start:
    print(json.dumps({"ts": time.time(), "event": "train.resumed", "step": start, "rank": rank}), flush=True)
for step in range(start, STEPS):
    x = torch.randn(16, 4)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    state.extra["step"] = step
    print(
        json.dumps(
            {
                "ts": time.time(),
                "event": "train.step",
                "step": step,
                "rank": rank,
                "world_size": world,
                "loss": round(loss.item(), 5),
            }
        ),
        flush=True,
    )
    time.sleep(STEP_TIME)
    if ckpt.step_end(step, state):
        break
ckpt.close()
print(
    json.dumps({"ts": time.time(), "event": "train.done", "step": state.extra["step"], "rank": rank}),
    flush=True,
)
# Exit at once: everything is saved and printed. On this shared 2-core machine a rank sometimes never
# finished exiting after `train.done` (destroy_process_group/interpreter shutdown once its peer had gone),
# which would make this test about that rather than about the AWS path (reported separately).
sys.stdout.flush()
os._exit(0)
