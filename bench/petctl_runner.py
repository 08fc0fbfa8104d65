"""petctl side of the benchmark: real agents (one process session each) against a real etcd.

No provider in between, like tests/support/agent_harness.py: each node is
`python -m petctl.agent.main --config agent.json` in its own session, and the benchmark plays the outside
world (notices through the local metadata endpoint, SIGKILL, SIGSTOP, a new node).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import Node, start_node, stop_nodes
from petctl.core.spec import AgentConfig, JobSpec
from petctl.core.store import StoreError
from petctl.io.store import open_store
from petctl.jobview.live import JobState, read_job_state

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every node process (petctl importable, no stray torchrun variables)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "PETCTL_", "MASTER_", "BENCH_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class PetctlJob:
    """One job's agents. `spec` is written into every agent's config (no etcd `spec` key needed)."""

    root: Path
    endpoint: str
    spec: JobSpec
    imds: Any = None  # a started LocalMetadataServer, or None (no preemption watcher)
    python: str = sys.executable  # the agents' interpreter, and so their workers'
    nodes: dict[str, Node] = field(default_factory=dict)
    _count: int = 0
    # The agents' in-memory snapshot directories go under a root of this job's own, removed by `stop`: the
    # benchmark SIGKILLs its nodes, and an agent killed so cannot remove its directory itself.
    snapshot_root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(
        prefix="petctl-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)))

    @classmethod
    def create(cls, root: Path, endpoint: str, name: str, *, min_size: int, max_size: int, size: int,
               script: Path = BENCH / "workload.py", env: dict[str, str] | None = None,
               checkpoint_url: str = "", imds: Any = None, max_restarts: int = 3,
               **timeouts: float) -> PetctlJob:
        spec = JobSpec(name=name, min_size=min_size, max_size=max_size, size=size,
                       entrypoint=script.name, code_url=f"file://{script}", etcd_endpoint=endpoint,
                       env=dict(env or {}), max_restarts=max_restarts, checkpoint_url=checkpoint_url)
        for key, value in timeouts.items():
            setattr(spec.timeouts, key, value)
        spec.validate()
        return cls(root=root, endpoint=endpoint, spec=spec, imds=imds)

    def start(self, node_id: str | None = None) -> Node:
        self._count += 1
        node_id = node_id or f"i-{self.spec.name}-{self._count}"  # unique: notices are per node id
        work = self.root / node_id
        work.mkdir(parents=True, exist_ok=True)
        config = AgentConfig(job=self.spec, node_id=node_id, work_dir=str(work),
                             imds_endpoint=self.imds.endpoint_for(node_id) if self.imds else "")
        cfg = work / "agent.json"
        cfg.write_text(config.to_json())
        node = start_node(node_id, [self.python, "-m", "petctl.agent.main", "--config", str(cfg)],
                          work / "agent.log", env=node_env({"PETCTL_SNAPSHOT_ROOT": str(self.snapshot_root)}),
                          cwd=REPO)
        self.nodes[node_id] = node
        return node

    def notice(self, node_id: str, grace: float, kind: str = "spot") -> float:
        """Write a preemption notice for `node_id` (kill time = now + grace); returns the notice time."""
        assert self.imds is not None, "job created without a metadata endpoint"
        now = time.time()
        path = Path(self.imds.notices_dir) / f"{node_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"kind": kind, "time": now + grace}))
        os.replace(tmp, path)
        return now

    def state(self) -> JobState:
        """Raises StoreError when etcd does not answer."""
        store = open_store(self.endpoint, self.spec.etcd_store, timeout=5.0)  # type: ignore[arg-type]
        try:
            return read_job_state(store, self.spec.name)
        finally:
            store.close()

    def frozen_ranks(self, world: int) -> dict[str, int] | None:
        try:
            st = self.state()
        except StoreError:  # etcd restarting under the benchmark: not frozen yet, poll again
            return None
        return st.ranks if st.state == "running" and st.world_size == world else None

    def stop(self) -> None:
        stop_nodes(list(self.nodes.values()))
        shutil.rmtree(self.snapshot_root, ignore_errors=True)
