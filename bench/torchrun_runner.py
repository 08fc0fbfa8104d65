"""torchrun side of the benchmark (the anchor): one `torchrun` per simulated node, same workload.

All nodes run on 127.0.0.1: `--local-addr 127.0.0.1` makes every agent advertise loopback. With c10d,
every node on loopback would believe it is the store host (torch's heuristic matches the endpoint against
the machine's addresses), so the first node is told `is_host=1`; the others try, find the port taken and
fall back to being clients (told `is_host=0` they failed to join a running job). That node
hosts the store for the whole job, a single point of failure of the c10d backend, so the scenarios never
take it away: they remove the last-started node, as they remove the highest rank on petctl's side.
"""

from __future__ import annotations

import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.petctl_runner import BENCH, REPO, node_env
from bench.procs import Node, start_node, stop_nodes
from petctl.io.procs import free_port

# torchrun's knobs, tuned the way its docs suggest for fast reaction on a LAN (the anchor's best case).
TUNED_RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60"
MONITOR_INTERVAL = 0.1
# torch >= 2.4 shares the rendezvous TCPStore with the workers by default. With it, a node that joins a
# running job (P3) waits for a MASTER_ADDR key that rank 0, holding its cached bootstrap info, never
# writes for the new round, and fails after 60 s (seen with torch 2.13, c10d and etcd-v2). torch's own
# opt-out restores a working scale-up, so the anchor runs with it everywhere.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_cmd(python: str | None = None) -> list[str]:
    """torchrun's command: `torchrun` from PATH, or with `python` (or where it is missing) that
    interpreter's `-m torch.distributed.run`, the same entry point."""
    exe = None if python else shutil.which("torchrun")
    return [exe] if exe else [python or sys.executable, "-m", "torch.distributed.run"]


@dataclass
class TorchrunJob:
    root: Path
    backend: str  # "c10d" | "etcd-v2"
    nnodes: str  # "MIN:MAX"
    endpoint: str  # host:port of the c10d store or of etcd
    run_id: str
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 3
    script: Path = BENCH / "workload.py"
    rdzv_conf: str = TUNED_RDZV_CONF
    python: str | None = None  # the agents' interpreter, and so their workers' (None: `torchrun_cmd()`'s)
    nodes: dict[str, Node] = field(default_factory=dict)
    _count: int = 0

    @classmethod
    def create(cls, root: Path, backend: str, min_nodes: int, max_nodes: int, run_id: str, *,
               etcd_port: int | None = None, **kwargs) -> TorchrunJob:
        if backend == "c10d":
            endpoint = f"127.0.0.1:{free_port()}"
        elif backend == "etcd-v2":
            assert etcd_port is not None
            endpoint = f"127.0.0.1:{etcd_port}"
        else:
            raise ValueError(f"unknown torchrun backend {backend!r}")
        return cls(root=root, backend=backend, nnodes=f"{min_nodes}:{max_nodes}", endpoint=endpoint,
                   run_id=run_id, **kwargs)

    def command(self, host: bool) -> list[str]:
        conf = self.rdzv_conf
        if self.backend == "c10d":  # the first node hosts the store; the rest are clients
            conf += ",is_host=1" if host else ""
        return [*torchrun_cmd(self.python), f"--nnodes={self.nnodes}", "--nproc-per-node=1",
                f"--rdzv-backend={self.backend}", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.run_id}", f"--max-restarts={self.max_restarts}",
                f"--monitor-interval={MONITOR_INTERVAL}", f"--rdzv-conf={conf}",
                "--local-addr=127.0.0.1", str(self.script)]

    def start(self, name: str | None = None) -> Node:
        self._count += 1
        name = name or f"t{self._count}"
        node = start_node(name, self.command(host=self._count == 1), self.root / name / "torchrun.log",
                          env=node_env({**TORCHRUN_ENV, **self.env, "LOGLEVEL": "INFO"}), cwd=REPO)
        self.nodes[name] = node
        if self.backend == "c10d" and self._count == 1:
            self._wait_for_store(node)  # else a later node may bind the port first and the host fails
        return node

    def _wait_for_store(self, node: Node, timeout: float = 120.0) -> None:
        host, port = self.endpoint.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and node.alive:
            try:
                with socket.create_connection((host, int(port)), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)

    def stop(self) -> None:
        stop_nodes(list(self.nodes.values()))
