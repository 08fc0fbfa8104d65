"""What every AWS operation of petctl works in: the installation's settings, one AWS session, the stacks'
names and operations, the job's S3 records, and the progress line. The leaf the provider's modules take
(`basestack`, `launch`, `jobrecords`): they are given an `AwsContext`, never the provider, so
none of them imports the provider that imports them (no loop; `.importlinter`'s no-loops contract).
`AwsProvider` is an `AwsContext` that also implements the `Provider` interface's capacity methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from petctl.core.errors import NotSetUp
from petctl.io.aws import AwsSession
from petctl.io.config import PetctlConfig
from petctl.providers.aws import capacity
from petctl.providers.aws.stacks import StackOps, stderr_progress
from petctl.providers.aws.storage import JobStore
from petctl.providers.base import Provider


class AwsContext(Provider):
    """The plumbing shared by the AWS provider's operations (abstract: `AwsProvider` is the concrete one)."""

    name = "aws"

    def __init__(self, config: PetctlConfig) -> None:
        super().__init__(config)
        self.poll_interval = 5.0  # seconds between CloudFormation / Auto Scaling polls (tests lower it)
        self.wait_timeout = 1200.0  # how long run_job waits for EC2 to launch the instances
        self.progress: Callable[[str], None] = stderr_progress
        self._cached: tuple[tuple[str, str, str], AwsSession] | None = None
        self._etcd_answers: dict[str, bool] = {}  # endpoint -> whether it answered (once per provider)

    # --- plumbing ----------------------------------------------------------------------------------
    def session(self, settings: dict[str, Any] | None = None) -> AwsSession:
        """One session (and its clients) per provider object and region/profile/endpoint."""
        s = settings if settings is not None else self.settings
        key = (s.get("region", ""), s.get("profile", ""), s.get("endpoint_url", ""))
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, AwsSession.create(region=key[0], profile=key[1], endpoint_url=key[2]))
        return self._cached[1]

    def stacks(self, session: AwsSession) -> StackOps:
        return StackOps(session.client("cloudformation"), poll=self.poll_interval, progress=self.progress)

    def require_ready(self) -> dict[str, Any]:
        """The settings of a completed setup. Raises NotSetUp."""
        if not self.settings.get("ready"):
            raise NotSetUp("petctl is not set up on AWS: run "
                           "`petctl setup --provider aws --option region=REGION`")
        return self.settings

    @property
    def base_stack(self) -> str:
        return self.settings.get("stack_name", "petctl")

    def job_stack(self, job: str) -> str:
        return f"{self.base_stack}-job-{job}"

    def store(self, session: AwsSession, job: str) -> JobStore:
        return JobStore(session.client("s3"), self.require_ready()["outputs"]["BucketName"], job)

    def stack_role(self) -> str:
        """The base stack's CloudFormation service role, which creates and deletes job stacks (the
        caller's own permissions, or a worker's, are not what deletes a job's IAM role)."""
        role = self.require_ready()["outputs"].get("JobStackRoleArn", "")
        if not role:
            raise NotSetUp("the base stack predates job stacks' service role: run `petctl setup --provider "
                           "aws` again to update it")
        return role

    def etcd_endpoint(self) -> str:
        return self.require_ready()["outputs"]["EtcdEndpoint"]

    def fallback_poller(self, name: str) -> Callable[[int], None]:
        """fallback_az at each poll of run_job's wait, its failures reported but never fatal."""
        return capacity.poller(lambda in_service: self.fallback_az(name, in_service), name, self.progress)

    def fallback_az(self, name: str, in_service: int | None = None) -> str | None:
        """Move the job's group to its next AZ if its newest launch failed for lack of capacity there
        (see capacity.fall_back); returns the new AZ, or None when it stays."""
        session = self.session()
        return capacity.fall_back(session, self.store(session, name), self.job_stack(name), name,
                                  in_service, self.progress)
