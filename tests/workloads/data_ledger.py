"""The sample ledger of the framework data tests (tests/e2e/test_framework_data_exactly_once.py), shared by
tests/workloads/hf_data.py and lightning_data.py.

Each sample carries its dataset index. Every rank notes the indices its micro-batches read; at each
optimizer step end every rank hands its list to rank 0 (`all_gather_object`, in rank order), and rank 0
appends one JSON line to `$LEDGER_DIR/ledger.jsonl`: `{"event": "step", "step": i (0-based), "world": W,
"ranks": [[indices of rank 0], [rank 1], ...], "round", "ts"}`, `resumed` when a round starts training
and `done` at the last step. A step's global positions are rank r's i-th sample at r + i * W (the
sampler's stride), which is how tests/support/dataledger.py puts a step back in order.
"""

import json
import os
import time

import torch
import torch.distributed as dist

SIZE = 41  # samples per epoch: a few steps each at world 1-3 (4 samples per rank), many epoch boundaries


class Indexed(torch.utils.data.Dataset):
    """`SIZE` samples of a learnable toy task; item i carries i."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.full((4,), float(i % 7) / 7)
        return {"x": x, "labels": x.sum(dim=0, keepdim=True), "idx": torch.tensor(i)}


class SampleLedger:
    def __init__(self) -> None:
        directory = os.environ.get("LEDGER_DIR")
        self.path = os.path.join(directory, "ledger.jsonl") if directory else None
        self.pending: list[int] = []
        self.rank = int(os.environ.get("RANK", "0"))

    def read(self, idx: torch.Tensor) -> None:
        """A micro-batch of this rank read these samples."""
        self.pending.extend(int(i) for i in idx.reshape(-1).tolist())

    def step_end(self, step: int) -> None:
        """Optimizer step `step` (0-based) is done on every rank: collective."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        everyone: list = [None] * world
        if world > 1:
            dist.all_gather_object(everyone, self.pending)
        else:
            everyone = [self.pending]
        self.pending = []
        self.write("step", step=step, world=world, ranks=everyone)

    def write(self, event: str, **fields) -> None:
        if self.path and self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"ts": time.time(), "event": event,
                                    "round": int(os.environ.get("PETCTL_ROUND", "0")), **fields}) + "\n")
