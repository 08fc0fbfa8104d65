"""The one interface every capacity backend implements (modelled on Ray's NodeProvider and
torch.distributed.elastic's narrow ABCs): the CLI never branches on which provider it has.

Job *state* (ranks, rounds, restarts) belongs to the agents and lives in etcd; providers own *capacity*
(instances, their count, their teardown) and know how to reach the job's etcd.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from petctl.core.config import PetctlConfig
from petctl.core.spec import JobSpec


@dataclass
class HostInfo:
    """One instance of a job's capacity, as the provider sees it."""

    host_id: str
    state: str  # pending | running | frozen | terminating | terminated
    instance_type: str = "local"
    az: str = ""
    market: str = ""  # spot | on-demand | local
    private_ip: str = ""
    launched_at: float | None = None
    rank: int | None = None  # filled from etcd by the CLI when the agent has one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Check:
    """One line of `petctl doctor`: what was checked, OK/FAIL/SKIP, and why."""

    name: str
    status: str  # OK | FAIL | SKIP
    reason: str = ""

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.reason}"


@dataclass
class JobInfo:
    name: str
    state: str  # running | succeeded | failed | killed | unknown
    min_size: int
    max_size: int
    desired: int
    created_at: float
    provider: str
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Provider(ABC):
    """Capacity for jobs. Methods raise `PetctlError` subclasses with user-facing messages."""

    name: str = ""

    def __init__(self, config: PetctlConfig) -> None:
        self.config = config

    @property
    def settings(self) -> dict[str, Any]:
        return self.config.section(self.name)

    def default_timeouts(self):
        """The agent timeouts a job gets before `--timeout` overrides: LAN values by default; a provider
        whose etcd is reached over a real network overrides them."""
        from petctl.core.spec import Timeouts

        return Timeouts()

    # --- shared infrastructure -------------------------------------------------------------------
    @abstractmethod
    def setup(self, **options: Any) -> dict[str, Any]:
        """Create what all jobs share; returns what was recorded in the config."""

    @abstractmethod
    def teardown(self, force: bool = False) -> None:
        """Remove what setup created; refuses while jobs run unless `force`."""

    # --- jobs ------------------------------------------------------------------------------------
    @abstractmethod
    def create_job(self, spec: JobSpec, script: Path) -> JobInfo:
        """Upload `script` (file or directory) and start `spec.size` instances running the agent."""

    @abstractmethod
    def kill_job(self, name: str) -> None:
        """Delete the job's capacity, and only it."""

    @abstractmethod
    def scale(self, name: str, size: int) -> None:
        """Set the desired instance count (validated against the job's [min, max])."""

    @abstractmethod
    def hosts(self, name: str) -> list[HostInfo]:
        ...

    @abstractmethod
    def terminate_host(self, name: str, host_id: str | None, mode: str = "kill", grace: float = 0.0) -> str:
        """Take one instance away (chaos/testing). mode: kill | freeze | term | notice. Returns its id."""

    @abstractmethod
    def jobs(self) -> list[JobInfo]:
        ...

    @abstractmethod
    def job(self, name: str) -> JobInfo:
        """One job; raises JobNotFound."""

    @abstractmethod
    def etcd_endpoint(self) -> str:
        """Where this provider's jobs keep their rendezvous and state (reachable from the CLI)."""

    def node_states(self, name: str):
        """The job's live state as its agents publish it (etcd). A provider whose CLI cannot reach etcd
        (AWS, etcd inside the VPC) overrides this to read the agents' status mirror instead."""
        from petctl.io.etcd import etcd_client
        from petctl.jobstate import read_job_state

        return read_job_state(etcd_client(self.etcd_endpoint()), name)

    def scaling_activities(self, name: str) -> list[str]:
        """Why capacity is (not) arriving, newest first, one line each ([] where nothing explains it)."""
        return []

    def doctor(self) -> list[Check]:
        """Checks of what this provider needs before a job can run (quotas, images, permissions)."""
        return [Check("provider", "SKIP", f"no checks for the {self.name} provider")]

    def cost(self, name: str, events: list[dict[str, Any]], now: float | None = None):
        """A `petctl.cost.CostReport` for the job's instance hours, or None where nothing is billed."""
        return None

    def mirror_url(self, name: str) -> str:
        """The job's prefix the agents mirror status/events/logs to ("" if none)."""
        return ""

    def job_events(self, name: str) -> list[dict[str, Any]]:
        """The job's timeline: etcd's copy while the job runs, merged with the agents' mirror in the
        job's prefix (which outlives etcd, the stack and the instances). Sorted by time."""
        from petctl.timeline import read_events

        endpoint = ""
        try:
            endpoint = self.etcd_endpoint()
        except Exception:  # no etcd reachable (AWS from outside the VPC): the mirror alone
            pass
        return read_events(name, endpoint, self.mirror_url(name))

    @abstractmethod
    def logs(self, name: str, node: str | None = None, follow: bool = False) -> Iterator[str]:
        """Lines of the job's node logs, each prefixed with its node id unless one node is asked for."""
