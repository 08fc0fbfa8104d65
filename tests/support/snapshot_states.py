"""The snapshot tier tests' model and checks: a small float64 model (BatchNorm buffers included) trained one
seeded step at a time, a deep copy of its values, an exact comparison of nested state, and a snapshot file
read back the way a resuming rank reads it."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from petctl.core.snapshotrecord import HEADER_SIZE, SnapshotHeader
from petctl.elastic import State
from petctl.elastic.snapshots.codec import decode
from petctl.io.snapshotfiles import read_header


def make_state(seed: int = 0, width: int = 64) -> State:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width),
                                torch.nn.Linear(width, 1)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return State(model=model, optimizer=opt, scheduler=sched, extra={"step": -1, "note": "x"})


def train(state: State, step: int, width: int = 64) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, width, generator=gen, dtype=torch.float64)
    state.optimizer.zero_grad()
    state.model(x).pow(2).mean().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.extra["step"] = step


def frozen(state: State) -> dict:
    """A deep copy of the state's values, to compare with what a snapshot holds."""
    return torch.load(io.BytesIO(_saved(state.state_dict())), weights_only=True)


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def read_back(path: Path) -> tuple[SnapshotHeader, dict]:
    header = read_header(path)
    data = bytearray(path.read_bytes()[HEADER_SIZE:HEADER_SIZE + header.payload_length])
    return header, decode(data, header.data_length, header.meta_offset, header.meta_length)
