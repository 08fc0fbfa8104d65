"""The AWS provider: a base CloudFormation stack per installation, a job stack (launch template + spot
Auto Scaling group) per job, the job's code and status in S3. Same `Provider` interface as local, plus
the chaos (EC2 terminate), pricing, diagnostics and capacity-insight capabilities.

Settings live in `config.section("aws")`: region, profile, endpoint_url, stack_name, store (the etcd
API the jobs use: basestack.stack_store), outputs (the base stack's), image (a default --image; "" boots
the Deep Learning AMI), worker_ami, root_volume_gb and `ready`. This class wires the AWS session, the
stacks and the job's S3 prefix to the modules that do each job: basestack.py (setup, teardown),
launch.py (run_job), jobrecords.py (jobs, kill_job), capacity.py, inventory.py. Nothing here imports boto3 at
module level.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from petctl.core.errors import JobNotFound, ProviderError, ValidationError
from petctl.core.spec import AgentConfig, JobSpec, JobSubmission, Timeouts
from petctl.core.store import BACKENDS, Backend
from petctl.io.aws import aws_errors
from petctl.jobview.prefix import follow_chunks, log_nodes
from petctl.jobview.view import JobSources
from petctl.providers.aws import basestack, inventory, jobrecords, launch
from petctl.providers.aws.context import AwsContext
from petctl.providers.aws.storage import JobStore
from petctl.providers.base import Check, HostInfo, JobInfo
from petctl.providers.capabilities import check_chaos_mode

if TYPE_CHECKING:
    from petctl.core.boots import BootReport
    from petctl.providers.aws.pricing import AwsPrices

AWS_HEARTBEAT_INTERVAL = 2.0  # seconds; see aws_timeouts
AWS_HEARTBEAT_TTL = 10.0


def aws_timeouts() -> Timeouts:
    """An AWS job's agent timeouts before `--timeout` overrides them (`AwsProvider.default_timeouts`).
    Heartbeats for an etcd on a burstable t3 host reached over the VPC: a TTL of 3 s (a LAN value) drops
    healthy nodes on one slow etcd write or a CPU-credit stall. 2 s refreshes and a 10 s TTL tolerate
    four missed refreshes and still drop a frozen host in seconds, far below NCCL's collective timeout.
    The benches that measure an AWS-sized fleet on one machine use them too (bench/fleetreal.py)."""
    return Timeouts(heartbeat_interval=AWS_HEARTBEAT_INTERVAL, heartbeat_ttl=AWS_HEARTBEAT_TTL)


class AwsProvider(AwsContext):
    name = "aws"
    run_options = frozenset({"instance_types", "on_demand", "on_demand_base", "spot_strategy", "multi_az",
                             "image", "requirements"})
    chaos_modes: ClassVar[tuple[str, ...]] = ("kill",)  # EC2 terminate-instances, as a reclaim would

    def default_timeouts(self) -> Timeouts:
        return aws_timeouts()

    # --- capacity ----------------------------------------------------------------------------------
    def setup(self, **options: Any) -> dict[str, Any]:
        return basestack.setup(self, options)

    def teardown(self, force: bool = False) -> None:
        basestack.teardown(self, force)

    def create_job(self, job: JobSubmission) -> JobInfo:
        launch.create_job(self, job)
        return self.job(job.spec.name)

    def render_job_template(self, spec: JobSpec, agent: AgentConfig, config_url: str,
                            subnet_ids: list[str] | None = None) -> str:
        """The job stack's template (public so tests can read exactly what would be deployed)."""
        return launch.render_job_template(self, spec, agent, config_url, subnet_ids)

    def kill_job(self, name: str) -> None:
        jobrecords.kill(self, name)

    def scale(self, name: str, size: int) -> None:
        self.require_ready()
        autoscaling = self.session().client("autoscaling")
        group = inventory.group(autoscaling, self.job_stack(name), name)
        if not group["MinSize"] <= size <= group["MaxSize"]:
            raise ValidationError(f"size {size} is outside the job's [min {group['MinSize']}, "
                                  f"max {group['MaxSize']}]")
        with aws_errors(f"scale job {name}"):
            autoscaling.set_desired_capacity(AutoScalingGroupName=self.job_stack(name), DesiredCapacity=size,
                                             HonorCooldown=False)

    def hosts(self, name: str) -> list[HostInfo]:
        self.require_ready()
        session = self.session()
        self.job(name)  # JobNotFound for an unknown job
        return inventory.hosts(session.client("ec2"), self.base_stack, name)

    def jobs(self) -> list[JobInfo]:
        return jobrecords.list_jobs(self)

    def job(self, name: str) -> JobInfo:
        return jobrecords.job_info(self, name)

    def sources(self, name: str) -> JobSources:
        """The job's S3 prefix always; its etcd only when it answers from here (a VPN, or inside the VPC)."""
        endpoint = self.etcd_endpoint()
        if endpoint not in self._etcd_answers:
            self._etcd_answers[endpoint] = inventory.etcd_answers(endpoint, timeout=1.0)
        store = self.store(self.session(), name)
        answers = self._etcd_answers[endpoint]
        backend = self._job_backend(store) if answers else basestack.stack_store(self.settings, "")
        session = self.session()

        def billing():  # each instance's launch and end, as EC2 and the group record them
            return inventory.billed(session.client("ec2"), session.client("autoscaling"), self.base_stack,
                                    name, self.job_stack(name))

        return JobSources(job=name, etcd_endpoint=endpoint if answers else "", etcd_store=backend,
                          mirror=store, logs=lambda node, follow: self._logs(name, store, node, follow),
                          billing=billing)

    def _job_backend(self, store: JobStore) -> Backend:
        """The etcd API the job's agents write with: its spec's (job.json), else the stack's store."""
        spec = store.get_json("job.json")
        backend = spec.get("etcd_store") if isinstance(spec, dict) else None
        return backend if backend in BACKENDS else basestack.stack_store(self.settings, "")

    def _logs(self, name: str, store: JobStore, node: str | None, follow: bool) -> Iterator[str]:
        """Node logs from the job's S3 prefix; they outlive the job's stack (kill_job keeps them)."""
        available = log_nodes(store)
        if not available:
            self.job(name)  # JobNotFound for a job that never existed
        if node and node not in available:
            raise ProviderError(f"no log for node {node!r} in job {name!r} yet (see `petctl hosts {name}`)")

        def running() -> bool:
            return self.job(name).state == "running"

        yield from follow_chunks(store, node, follow, running, max(self.poll_interval, 2.0))

    # --- capabilities ------------------------------------------------------------------------------
    def terminate_host(self, name: str, host_id: str | None, mode: str = "kill", grace: float = 0.0) -> str:
        """Terminate one instance through EC2 (as a reclaim would); the group launches a replacement."""
        check_chaos_mode(self, mode)
        hosts = self.hosts(name)
        live = [h for h in hosts if h.state in ("pending", "running")]
        if host_id is None:
            if not live:
                raise ProviderError(f"job {name!r} has no running instance to terminate")
            host_id = sorted(live, key=lambda h: (h.launched_at or 0, h.host_id))[-1].host_id
        elif host_id not in {h.host_id for h in hosts}:
            raise ProviderError(f"no instance {host_id!r} in job {name!r} (see `petctl hosts {name}`)")
        with aws_errors(f"terminate instance {host_id}"):
            self.session().client("ec2").terminate_instances(InstanceIds=[host_id])
        return host_id

    def prices(self) -> AwsPrices:
        """Spot and on-demand prices from AWS's published prices (cached a day, see pricing.py)."""
        from petctl.providers.aws.pricing import PRICING_REGION, AwsPrices

        session = self.session()
        return AwsPrices(session.client("ec2"), session.client("pricing", region=PRICING_REGION),
                         session.region, self.config.home / "cache" / "aws-prices.json")

    def doctor(self) -> list[Check]:
        """`petctl doctor`: credentials, base stack, quotas, AMI, image, permissions (see doctor.py)."""
        from petctl.providers.aws.doctor import run_checks

        return run_checks(self.session(), self.settings, self.base_stack)

    def boots(self, name: str) -> BootReport:
        """Each instance's boot stage, the boot breaker's view and the newest failure (inventory.report)."""
        self.require_ready()
        session = self.session()
        try:
            group = inventory.group(session.client("autoscaling"), self.job_stack(name), name)
        except JobNotFound:  # its stack is gone: the records say how it booted
            group = None
        return inventory.report(self.store(session, name), group)

    def scaling_activities(self, name: str) -> list[str]:
        """The group's latest scaling activities, explained (why instances are not launching)."""
        self.require_ready()
        session = self.session()
        if not self.stacks(session).describe(self.job_stack(name)):
            return []
        return [inventory.explain(a) for a in inventory.recent(session.client("autoscaling"),
                                                                 self.job_stack(name), limit=5)]
