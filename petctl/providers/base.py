"""The one interface every capacity backend implements (modelled on Ray's NodeProvider and
torch.distributed.elastic's narrow ABCs): the CLI never branches on which provider it has.

A provider owns *capacity*: what all jobs share (setup, teardown), a job's instances (create, scale,
kill, hosts) and the list of jobs. Job *state* (ranks, rounds, restarts) belongs to the agents, who
publish it to etcd and to the job's prefix; a provider only says where those are (`sources`), and the
read side (petctl.jobview) reads them the same way for every provider. What only some providers can do
(chaos, pricing, diagnostics, explaining capacity) are optional capabilities, in capabilities.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from petctl.core.spec import JobSubmission, Timeouts
from petctl.io.config import PetctlConfig

if TYPE_CHECKING:
    from petctl.jobview.view import JobSources


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
    rank: int | None = None  # filled from the job's state by the CLI when the agent has one

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

    name: ClassVar[str] = ""
    # The provider-specific `run_job` options it honours (names from petctl.core.spec.PROVIDER_OPTIONS);
    # a submission setting any other is refused by `JobSubmission.validate`.
    run_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: PetctlConfig) -> None:
        self.config = config

    @property
    def settings(self) -> dict[str, Any]:
        return self.config.section(self.name)

    def default_timeouts(self) -> Timeouts:
        """The agent timeouts a job gets before `--timeout` overrides: LAN values by default; a provider
        whose etcd is reached over a real network overrides them."""
        return Timeouts()

    def validate(self, job: JobSubmission) -> JobSubmission:
        """The submission checked for this provider (see `JobSubmission.validate`). Raises ValidationError."""
        return job.validate(self.name, self.run_options)

    # --- shared infrastructure -------------------------------------------------------------------
    @abstractmethod
    def setup(self, **options: Any) -> dict[str, Any]:
        """Create what all jobs share; returns what was recorded in the config."""

    @abstractmethod
    def teardown(self, force: bool = False) -> None:
        """Remove what setup created; refuses while jobs run unless `force`."""

    # --- jobs ------------------------------------------------------------------------------------
    @abstractmethod
    def create_job(self, job: JobSubmission) -> JobInfo:
        """Validate `job` (before any side effect), upload its code and start `spec.size` instances."""

    @abstractmethod
    def kill_job(self, name: str) -> None:
        """Delete the job's capacity, and only it."""

    @abstractmethod
    def scale(self, name: str, size: int) -> None:
        """Set the desired instance count (validated against the job's [min, max])."""

    @abstractmethod
    def hosts(self, name: str) -> list[HostInfo]:
        """The job's instances, terminated ones included while the provider still knows them."""

    @abstractmethod
    def jobs(self) -> list[JobInfo]:
        """Every job on record, running or ended."""

    @abstractmethod
    def job(self, name: str) -> JobInfo:
        """One job; raises JobNotFound."""

    @abstractmethod
    def sources(self, name: str) -> JobSources:
        """Where the job's records are (its etcd when it answers from here, its prefix, its logs), for
        the read side. Raises JobNotFound where the provider can tell the job never existed."""
