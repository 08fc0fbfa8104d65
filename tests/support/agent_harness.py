"""Start real agents (each its own process group, like an instance) against a real etcd, for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.core.eventlog import parse_line
from petctl.core.spec import AgentConfig, JobSpec
from petctl.core.store import Store
from petctl.jobview.live import JobState, read_job_state
from tests.support.paths import REPO, WORKLOADS
from tests.support.store import store_for

READ_TIMEOUT = 10.0  # seconds one of the test's own etcd reads may take on a loaded machine


@dataclass
class AgentProc:
    node_id: str
    proc: subprocess.Popen
    log: Path

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            record = parse_line(line)
            if record is not None and (name is None or record["event"] == name):
                out.append(record)
        return out

    def ready(self) -> bool:
        """Done getting ready to train (workers warmed: torch imported; the checkpoint prefetched), which
        an agent does before it registers: at this machine's speed, not the rendezvous's."""
        return any("round" not in e for e in self.events("workers.warm_ready")) \
            or bool(self.events("rendezvous.joined"))

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class AgentCluster:
    """A job's agents, started by hand (no provider): what the agent tests drive."""

    endpoint: str
    root: Path
    spec: JobSpec
    agents: dict[str, AgentProc] = field(default_factory=dict)
    status_url: str = ""
    _count: int = 0
    _store: Store | None = None

    def start(self, node_id: str | None = None, imds: Callable[[str], str] | None = None, *,
              prefix: Sequence[str] = (), host_addr: str = "",
              env: dict[str, str] | None = None) -> AgentProc:
        """Start one agent; `imds(node_id)` gives its metadata endpoint (preemption notices).

        `prefix` goes before the command (`ip netns exec NS`: the agent and its workers in a network
        namespace; it execs, so the pid is still the agent's), `host_addr` is the address its peers use
        (default the config's 127.0.0.1), `env` adds to its environment and its workers' (e.g.
        GLOO_SOCKET_IFNAME)."""
        self._count += 1
        node_id = node_id or f"n{self._count}"
        work = self.root / node_id
        work.mkdir(parents=True, exist_ok=True)
        cfg = work / "agent.json"
        config = AgentConfig(job=self.spec, node_id=node_id, work_dir=str(work),
                             imds_endpoint=imds(node_id) if imds else "", status_url=self.status_url)
        if host_addr:
            config.host_addr = host_addr
        cfg.write_text(config.to_json())
        log = work / "agent.log"
        with open(log, "ab") as out:
            cmd = [*prefix, sys.executable, "-m", "petctl.agent.main", "--config", str(cfg)]
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True, env={**os.environ, **env} if env else None)
        agent = AgentProc(node_id, proc, log)
        self.agents[node_id] = agent
        return agent

    def state(self) -> JobState:
        """The job's state as etcd holds it, read through one store kept open for the cluster's life.

        One connection, not one per poll: a test polls every 0.1 s, and a fresh gRPC channel each time
        (its handshake, its loop thread) is what timed out on a starved 2-core box ("timed out before
        receiving SETTINGS frame"), failing the test for a reader's cost, not the agents'. The reader
        is not under test, so its calls may take READ_TIMEOUT."""
        if self._store is None:
            self._store = store_for(self.endpoint, backend=self.spec.etcd_store,  # type: ignore[arg-type]
                                    timeout=READ_TIMEOUT)
        return read_job_state(self._store, self.spec.name)

    def steps(self, node_id: str) -> list[dict[str, Any]]:
        return self.agents[node_id].events("train.step")

    def stop_all(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        for agent in self.agents.values():
            agent.signal_group(signal.SIGCONT)
            agent.signal_group(signal.SIGKILL)
        for agent in self.agents.values():
            try:
                agent.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def make_spec(name: str, endpoint: str, *, min_size: int, max_size: int, size: int | None = None,
              env: dict[str, str] | None = None, max_restarts: int = 3, script: str = "steps.py",
              checkpoint_url: str = "", **timeouts: float) -> JobSpec:
    spec = JobSpec(name=name, min_size=min_size, max_size=max_size, size=size or min_size,
                   entrypoint=script, code_url=f"file://{WORKLOADS / script}", etcd_endpoint=endpoint,
                   env=env or {}, max_restarts=max_restarts, checkpoint_url=checkpoint_url)
    spec.timeouts.heartbeat_interval = 0.2  # the default: members watch each other (agent/liveness.py)
    spec.timeouts.heartbeat_ttl = 2.0
    spec.timeouts.stop_grace = 2.0
    spec.timeouts.initial_wait = 20.0
    for key, value in timeouts.items():
        setattr(spec.timeouts, key, value)
    return spec


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}; last={last!r}")


# How long agents may take to get ready on this machine: torch's import alone took 14 s for each of two
# agents on a 2-core box at twice CI's load, and more beside a third. A bound on the box, not the product:
# a test times the product from here (`wait_ready`, then its own bound on the join).
READY_BOUND = 180.0


def wait_ready(agents: Sequence[AgentProc], timeout: float = READY_BOUND) -> None:
    """Wait until every one of `agents` is ready to train (`AgentProc.ready`)."""
    wait_for(lambda: all(a.ready() for a in agents), timeout,
             what=f"{', '.join(a.node_id for a in agents)} ready to train")


def dump(value: Any) -> str:
    return json.dumps(value, default=str, indent=1)[:4000]
