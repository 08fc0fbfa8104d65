"""A simulated instance: one agent process group with its own work dir and log.

Each instance is the agent started in a new session, so its pid is also its process group id and every
chaos signal (SIGKILL a vanished host, SIGSTOP a frozen one) reaches the agent and its workers at once,
as losing a machine would.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from petctl.core.spec import AgentConfig, JobSpec
from petctl.io.procs import ProcRef, die_with_parent, host_cores
from petctl.providers.local.jobdir import JobDir


def agent_command(config_path: str) -> list[str]:
    return [sys.executable, "-m", "petctl.agent.main", "--config", config_path]


def new_instance_id() -> str:
    """Unique per launch (like EC2's), so a replacement is never mistaken for the node it replaces."""
    return "i-" + secrets.token_hex(4)


def host_threads(spec: JobSpec, env: Mapping[str, str], cpus: int) -> dict[str, str]:
    """The instance's share of this machine's cores, as its host's `OMP_NUM_THREADS`: `cpus` split among
    the most workers the job may run here (`--max` instances of `--nproc-per-node`), at least 1. Nothing
    where the user's environment or the job's sets it.

    Why: each instance stands for a host of its own, but they all share these cores. A worker's torch
    sizes its thread pool to every core it sees, so without a share 2 instances on 2 cores ran 4 compute
    threads, and OpenMP's waiting threads spin (an HF Trainer job: 2.8 times the CPU, 1.8 times as long).
    On AWS a host's cores are its own: the agent leaves them to torch, or to torchrun's default
    (`agent/workers.py`, `torchrun_threads`)."""
    if "OMP_NUM_THREADS" in env or "OMP_NUM_THREADS" in spec.env:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cpus // (spec.max_size * spec.nproc_per_node)))}


@dataclass
class Instance:
    """One row of instances.json: the instance's whole life, kept after it ended (billing reads it).

    Billed from `launched_at` (the provider launched it) to `ended_at` (terminated or reclaimed). A
    replacement boots first (`state` "booting", no process yet: `pid` 0) until `boot_until`; its agent
    starts at `booted_at`. `detached_at`: it left the group's count (the local DetachInstances) and runs on
    until it exits by itself or is reclaimed. `shutdown_at`: a detached instance asked to end (the local
    power-off); its billing ended then, as EC2's does once an instance is shutting down, while its agent
    finished exiting."""

    id: str
    pid: int
    start: int | None
    launched_at: float
    state: str = "running"  # booting | running | frozen | terminating | terminated
    reason: str = ""  # why it is terminating/terminated
    ended_at: float | None = None
    returncode: int | None = None
    booted_at: float | None = None  # when its agent started (None: still booting, or never did)
    boot_until: float | None = None  # a booting instance's agent starts at this time
    replaces: str = ""  # the instance this one was launched to replace ("" for a scale-up or the start)
    detached_at: float | None = None  # when it was detached from the group (None: never)
    shutdown_at: float | None = None  # when it asked to end itself (`Fleet.power_off`): billed until then

    @property
    def ref(self) -> ProcRef:
        return ProcRef(self.pid, self.start)

    @property
    def live(self) -> bool:
        """Launched and not ended: booting, running, frozen (detached or not)."""
        return self.state in ("booting", "running", "frozen")

    @property
    def has_process(self) -> bool:
        """Its agent was started (a booting instance has no process to signal)."""
        return self.pid > 0

    @property
    def detached(self) -> bool:
        return self.detached_at is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Instance:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def launch(job: JobDir, spec: JobSpec, iid: str | None = None, imds_endpoint: str = "",
           command: list[str] | None = None) -> tuple[Instance, subprocess.Popen]:
    """Start one agent for `spec`; the caller keeps the Popen to notice (and reap) its exit.

    `command` replaces the agent (tests use a stub); "{config}" in it becomes the agent.json path.
    """
    iid = iid or new_instance_id()
    root = job.instance(iid)
    work = root / "work"
    work.mkdir(parents=True, exist_ok=True)
    config = AgentConfig(job=spec, node_id=iid, host_addr="127.0.0.1", work_dir=str(work),
                         imds_endpoint=imds_endpoint, status_url=f"file://{job.mirror}")
    config_path = root / "agent.json"
    config_path.write_text(config.to_json())
    cmd = [part.replace("{config}", str(config_path)) for part in command] if command \
        else agent_command(str(config_path))
    env = {**os.environ, **host_threads(spec, os.environ, host_cores()), "PYTHONUNBUFFERED": "1",
           "PETCTL_INSTANCE_ID": iid}
    # SIGTERM the agent if its reconciler dies (even by SIGKILL), so a lost reconciler never leaves agents
    # behind; the agent then leaves gracefully and its workers die with it.
    with open(root / "agent.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=str(root), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent(signal.SIGTERM))
    ref = ProcRef.of(proc.pid)
    now = time.time()
    return Instance(id=iid, pid=proc.pid, start=ref.start, launched_at=now, booted_at=now), proc
