"""What a warm worker does ahead of its script: which imports it preloads, and the early store on rank 0."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from petctl.agent.warm_worker import await_store, host_store_early, preload, script_preloads
from petctl.io.procs import free_port

SCRIPT = '''
import argparse, json
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from petctl.elastic import Checkpointer, State
from . import sibling
import mylib.data

def main():
    from torch.utils.data import DataLoader
'''


def test_only_torch_and_petctl_elastic_imports_are_preloaded() -> None:
    assert script_preloads(SCRIPT) == ["torch", "torch.distributed", "torch:nn",
                                       "torch.nn.parallel:DistributedDataParallel",
                                       "petctl.elastic:Checkpointer", "petctl.elastic:State",
                                       "torch.utils.data:DataLoader"]
    assert script_preloads("import numpy\nfrom mylib import torch\n") == []  # the user's modules: never
    assert script_preloads("def broken(:\n") == []


def test_framework_imports_are_preloaded_also_from_the_scripts_own_modules(tmp_path) -> None:
    """tests/workloads/hf_train.py imports the framework through `examples.hf_trainer`: read, not run."""
    pkg = tmp_path / "examples"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import os\nfrom transformers import Trainer\n"
                                  "import lightning.pytorch as pl\nraise SystemExit('never imported')\n")
    script = "from examples.train import main\nfrom mylib import x\n"
    assert script_preloads(script, [str(tmp_path)]) == ["transformers:Trainer", "lightning.pytorch"]
    assert script_preloads(script) == []  # not under a root: the user's module is not read
    cycle = tmp_path / "a.py"
    cycle.write_text("import a\nimport accelerate\n")
    assert script_preloads("import a\n", [str(tmp_path)]) == ["accelerate"]  # read once


def test_after_the_order_lightnings_rank_zero_guard_knows_the_rank() -> None:
    from lightning_utilities.core.rank_zero import rank_zero_only

    from petctl.agent.warm_worker import after_order

    before = getattr(rank_zero_only, "rank", 0)
    try:
        after_order({"RANK": "2"})
        assert rank_zero_only.rank == 2
    finally:
        rank_zero_only.rank = before


def test_preload_loads_lazily_exported_names_and_submodules() -> None:
    preload("petctl.elastic:Checkpointer")
    import petctl.elastic

    assert "Checkpointer" in vars(petctl.elastic)  # the lazy export was resolved
    preload("torch:nn")
    with pytest.raises(ImportError):
        preload("petctl.elastic:NoSuchName")


def test_rank_zero_hosts_the_store_and_torch_adopts_it() -> None:
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    assert host_store_early({**env, "RANK": "1"}) is None
    assert host_store_early({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}) is None
    store = host_store_early(env)
    assert store is not None
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # listening before the script runs
    # What init_process_group's env:// rendezvous does on rank 0: it shares the running server.
    again = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=5), wait_for_workers=False,
                          multi_tenant=True)
    again.set("k", "v")
    assert store.get("k") == b"v"


def test_other_ranks_wait_for_rank_zeros_store_instead_of_torchs_backoff() -> None:
    """A client refused once backs off (measured: 0.54 s after a server 30 ms late). `await_store` polls
    the port every few ms, so torch's own connect then succeeds at its first try."""
    import threading
    import time

    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    assert await_store({**env, "RANK": "0"}) is None  # rank 0 hosts it
    assert await_store({**env, "TORCHELASTIC_USE_AGENT_STORE": "true"}) is None
    assert await_store(env, timeout=0.05) is None  # nobody listening: bounded, then torch's turn

    started: dict[str, float] = {}

    def rank0_late() -> None:
        time.sleep(0.1)
        started["store"] = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10),
                                         wait_for_workers=False)
        started["at"] = time.monotonic()

    server = threading.Thread(target=rank0_late)
    server.start()
    waited = await_store(env)
    # It returned because the port accepts connections (not because it gave up): torch's first try then
    # finds the store up, where a refused client backs off. (How long torch's connect takes is a speed
    # figure, not asserted here.)
    assert waited is not None and waited > 0.05
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    client.set("k", "v")
    server.join(timeout=10)  # the server's constructor may return after the client connected
    assert started["store"].get("k") == b"v"
