"""The at-rest bench's worker (bench/rest.py): one `train.step` line every STEP_TIME seconds (default 0.1),
forever, and no torch, so a node's round stays steady while its step moves, and the machine's cores go
to the agents and etcd being measured rather than to training."""

import json
import os
import time

step_time = float(os.environ.get("STEP_TIME", "0.1"))
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
step = 0
while True:
    print(json.dumps({"ts": time.time(), "event": "train.step", "step": step, "rank": rank,
                      "world_size": world}), flush=True)
    step += 1
    time.sleep(step_time)
