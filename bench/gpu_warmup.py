"""What a warm worker could do ahead of its orders on a GPU host, imported by petctl's warm worker as a
preload module (`python -m petctl.agent.warm_worker torch,...,bench.gpu_warmup FD script`) in
bench/gpu.py's warm-start part. BENCH_WARM says how far:

- `runtime`: initialise the CUDA runtime (device count, no context on any device) and load NCCL. Safe
  before the worker knows its local rank: nothing is bound to a device, CUDA_VISIBLE_DEVICES is the
  node's (the agent does not set one per worker).
- `context`: also make the CUDA context on the device the worker will use (BENCH_WARM_DEVICE, default 0),
  and a first allocation. Safe only when the worker's device is known before its orders (one pooled
  worker per local rank); otherwise every warm worker would hold a context (hundreds of MB) on GPU 0.

Importing this module does the work (that is how a preload runs); nothing happens without CUDA.
"""

from __future__ import annotations

import os

import torch

MODE = os.environ.get("BENCH_WARM", "runtime")

if torch.cuda.is_available():
    torch.cuda.device_count()
    import torch.distributed  # noqa: F401  (ProcessGroupNCCL's bindings)

    torch.cuda.nccl.version()  # loads the NCCL library
    if MODE == "context":
        device = int(os.environ.get("BENCH_WARM_DEVICE", "0"))
        torch.cuda.set_device(device)
        torch.empty(1, device=torch.device("cuda", device))
