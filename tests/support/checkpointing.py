"""The Checkpointer tests' doubles and model: an EventLog kept in memory, a store that counts reads and can
hold uploads (a slow network), and a small model with AdamW and a scheduler trained and compared exactly."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import torch

from petctl.core.eventlog import parse_lines
from petctl.elastic import CheckpointStore, ObjectInfo, State
from petctl.io.eventlog import EventLog


class Recorder:
    """An EventLog writing to memory, for asserting on the structured events."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.log = EventLog("elastic", stream=self.stream)

    def events(self, name: str) -> list[dict]:
        return [e for e in parse_lines(self.stream.getvalue().splitlines()) if e["event"] == name]


class CountingStore(CheckpointStore):
    """Wraps a store, counts reads, and can hold uploads until released (a slow network)."""

    def __init__(self, inner: CheckpointStore, hold: threading.Event | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.hold = hold
        self.reads = 0
        self.uploading = threading.Event()

    def put_file(self, key: str, path: Path) -> None:
        self.uploading.set()
        if self.hold is not None:
            assert self.hold.wait(30), "test never released the upload"
        self.inner.put_file(key, path)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def get_file(self, key: str, path: Path) -> None:
        self.reads += 1
        self.inner.get_file(key, path)

    def get_bytes(self, key: str) -> bytes:
        self.reads += 1
        return self.inner.get_bytes(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: list[str]) -> None:
        self.inner.delete(keys)


def make_state(seed: int = 0) -> State:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return State(model=model, optimizer=opt, scheduler=sched, extra={"step": 0, "epoch": 0})


def train(state: State, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = state.model(x).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()


def assert_same(a: State, b: State) -> None:
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][pid][k]))
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert a.extra == b.extra
