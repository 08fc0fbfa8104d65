"""A tiny torchrun-style job for agent tests: all-reduce every step, print one JSON line per step.

Env knobs: STEPS (total steps, default endless), STEP_TIME (seconds per step), CRASH_AT (exit 1 at that
step on RANK 0), HANG_AT_EXIT_RANK (that rank never exits after its last step), so a test can produce
success, failure, stuck and long-running jobs from one script. LEDGER_DIR: once `$LEDGER_DIR/unpadded`
exists, steps no longer sleep STEP_TIME (the padding's end, tests/workloads/padding.py; this script runs
from a copy, without the repository on its path, so it reads the file itself).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
steps = int(os.environ.get("STEPS", "1000000"))
step_time = float(os.environ.get("STEP_TIME", "0.1"))
crash_at = int(os.environ.get("CRASH_AT", "-1"))
unpadded = os.path.join(os.environ["LEDGER_DIR"], "unpadded") if os.environ.get("LEDGER_DIR") else ""
for step in range(steps):
    if step == crash_at and rank == 0:
        print("crashing on purpose", flush=True)
        sys.exit(1)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(json.dumps({"ts": time.time(), "event": "train.step", "step": step, "rank": rank,
                      "world_size": int(t.item()), "restart": os.environ["TORCHELASTIC_RESTART_COUNT"]}),
          flush=True)
    if not (unpadded and os.path.exists(unpadded)):
        time.sleep(step_time)
if rank == int(os.environ.get("HANG_AT_EXIT_RANK", "-1")):
    time.sleep(3600)  # what a rank stuck in destroy_process_group after its peers left looks like
dist.destroy_process_group()
