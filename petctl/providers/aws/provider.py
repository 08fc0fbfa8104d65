"""The AWS provider: a base CloudFormation stack per installation, a job stack (launch template + spot
Auto Scaling group) per job, the job's code and status in S3. Same `Provider` interface as local.

Settings live in `config.section("aws")`: region, profile, endpoint_url, stack_name, outputs (the base
stack's), image, worker_ami, root_volume_gb and `ready`. Nothing here imports boto3 at module level.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from petctl.core.config import PetctlConfig
from petctl.core.errors import JobExists, JobNotFound, NotSetUp, ProviderError, ValidationError
from petctl.core.spec import AgentConfig, JobSpec, Timeouts
from petctl.io.aws import AwsSession, aws_errors
from petctl.providers.aws import azfallback, capacity, etcdbin, inventory
from petctl.providers.aws.instance_types import check_uniform_gpus, is_gpu, validate_instance_types
from petctl.providers.aws.network import DEFAULT_VPC_CIDR, plan_network
from petctl.providers.aws.placement import Placement
from petctl.providers.aws.stacks import StackOps, stderr_progress
from petctl.providers.aws.storage import JobStore, follow_logs, job_prefix, recorded_jobs
from petctl.providers.aws.templates import render_base, render_job
from petctl.providers.aws.userdata import BUCKET_PLACEHOLDER, WORKER_IMDS, etcd_user_data, worker_user_data
from petctl.providers.base import HostInfo, JobInfo, Provider

STACK_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
WORKER_AMI_PARAM = "/aws/service/ecs/optimized-ami/amazon-linux-2023/gpu/recommended/image_id"
ETCD_AMI_PARAM = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
LIFECYCLE_HOOK = "petctl-drain"
# AWS recommends price-capacity-optimized for spot: pools least likely to be interrupted, and of those the
# cheapest. capacity-optimized (least interruption, price ignored) stays selectable.
SPOT_STRATEGIES = ("price-capacity-optimized", "capacity-optimized")
NONCURRENT_DAYS = 1  # old object versions (status, checkpoints, mirror chunks) kept this long
AWS_HEARTBEAT_INTERVAL = 2.0  # seconds; see AwsProvider.default_timeouts
AWS_HEARTBEAT_TTL = 10.0
SETUP_OPTIONS = {  # every option `setup` accepts, with its default
    "region": "", "profile": "", "endpoint_url": "", "stack_name": "petctl", "vpc_cidr": DEFAULT_VPC_CIDR,
    "max_azs": "3", "image": "", "worker_ami": "", "etcd_ami": "", "etcd_instance_type": "t3.small",
    "root_volume_gb": "100", "etcd_binary": "",
}


class AwsProvider(Provider):
    name = "aws"

    def __init__(self, config: PetctlConfig) -> None:
        super().__init__(config)
        self.poll_interval = 5.0  # seconds between CloudFormation / Auto Scaling polls (tests lower it)
        self.wait_timeout = 1200.0  # how long run_job waits for instances to be in service
        self.progress = stderr_progress
        self._cached: tuple[tuple[str, str, str], AwsSession] | None = None

    def default_timeouts(self) -> Timeouts:
        """Heartbeats for an etcd on a burstable t3 host reached over the VPC: a TTL of 3 s (a LAN value)
        drops healthy nodes on one slow etcd write or a CPU-credit stall. 2 s refreshes and a 10 s TTL
        tolerate four missed refreshes and still drop a frozen host in seconds, far below NCCL's
        collective timeout."""
        return Timeouts(heartbeat_interval=AWS_HEARTBEAT_INTERVAL, heartbeat_ttl=AWS_HEARTBEAT_TTL)

    # --- plumbing ----------------------------------------------------------------------------------
    def _session(self, settings: dict[str, Any] | None = None) -> AwsSession:
        """One session (and its clients) per provider object and region/profile/endpoint."""
        s = settings if settings is not None else self.settings
        key = (s.get("region", ""), s.get("profile", ""), s.get("endpoint_url", ""))
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, AwsSession.create(region=key[0], profile=key[1], endpoint_url=key[2]))
        return self._cached[1]

    def _stacks(self, session: AwsSession) -> StackOps:
        return StackOps(session.client("cloudformation"), poll=self.poll_interval, progress=self.progress)

    def _ready(self) -> dict[str, Any]:
        if not self.settings.get("ready"):
            raise NotSetUp("petctl is not set up on AWS: run "
                           "`petctl setup --provider aws --option region=REGION`")
        return self.settings

    @property
    def _base(self) -> str:
        return self.settings.get("stack_name", "petctl")

    def _job_stack(self, job: str) -> str:
        return f"{self._base}-job-{job}"

    def _store(self, session: AwsSession, job: str) -> JobStore:
        return JobStore(session.client("s3"), self._ready()["outputs"]["BucketName"], job)

    def _stack_role(self) -> str:
        """The base stack's CloudFormation service role, which creates and deletes job stacks (the
        caller's own permissions, or a worker's, are not what deletes a job's IAM role)."""
        role = self._ready()["outputs"].get("JobStackRoleArn", "")
        if not role:
            raise NotSetUp("the base stack predates job stacks' service role: run `petctl setup --provider "
                           "aws` again to update it")
        return role

    def _reap(self, session: AwsSession, stack: dict[str, Any], result: Any) -> None:
        """A job whose result.json records its end, and whose stack still exists, gets its stack deleted
        (its agent already scaled the group to 0 and may not delete the stack itself). Not waited for."""
        if not inventory.ended(result) or stack["StackStatus"] == "DELETE_IN_PROGRESS":
            return
        job = _tags(stack).get("petctl:job", stack["StackName"])
        role = self.settings.get("outputs", {}).get("JobStackRoleArn", "")
        if not role:  # a base stack from before the service role: listing must still work
            self.progress(f"job {job} ended ({result['state']}); run `petctl setup --provider aws` again "
                          f"so petctl can delete its stack {stack['StackName']}")
            return
        self.progress(f"job {job} ended ({result['state']}): deleting its stack {stack['StackName']}")
        self._stacks(session).start_delete(stack["StackName"], role)

    # --- shared infrastructure ---------------------------------------------------------------------
    def setup(self, **options: Any) -> dict[str, Any]:
        """Create or update the base stack. Options (strings, as `--option KEY=VALUE` gives them):
        region, profile, endpoint_url, stack_name, vpc_cidr, max_azs, image, worker_ami, etcd_ami,
        etcd_instance_type, root_volume_gb."""
        opts = {k.replace("-", "_"): str(v) for k, v in options.items() if v not in (None, "")}
        opts.pop("provider", None)
        unknown = sorted(set(opts) - set(SETUP_OPTIONS))
        if unknown:
            raise ValidationError(f"unknown aws setup option(s) {', '.join(unknown)}: choose from "
                                  f"{', '.join(SETUP_OPTIONS)}")
        # What the user chose is remembered (settings["options"]); what was derived (AMIs, image) is not,
        # so a later `setup` picks up AWS's current AMIs unless the user pinned them.
        chosen = {**self.settings.get("options", {}), **opts}
        merged = {**SETUP_OPTIONS, **chosen}
        if not STACK_NAME_RE.match(merged["stack_name"]):
            raise ValidationError(f"invalid stack_name {merged['stack_name']!r}: 1-24 lowercase letters, "
                                  "digits and '-', starting with a letter")
        max_azs = _int_option("max_azs", merged["max_azs"], 2)
        root_gb = _int_option("root_volume_gb", merged["root_volume_gb"], 30)
        session = self._session(merged)
        with aws_errors("check the AWS credentials"):
            session.client("sts").get_caller_identity()
        stack = merged["stack_name"]
        plan = self._network_plan(session, merged["vpc_cidr"], max_azs)
        etcd = etcdbin.local_etcd(merged["etcd_binary"])
        ssm = session.client("ssm")
        etcd_ami = merged["etcd_ami"] or inventory.ssm_parameter(ssm, ETCD_AMI_PARAM)
        worker_ami = merged["worker_ami"] or inventory.ssm_parameter(ssm, WORKER_AMI_PARAM)
        body = render_base(stack_name=stack, plan=plan, etcd_ami=etcd_ami,
                           etcd_instance_type=merged["etcd_instance_type"],
                           etcd_user_data=etcd_user_data(stack, plan.etcd_ip, etcd.key, etcd.sha256,
                                                         etcd.version),
                           bucket_placeholder=BUCKET_PLACEHOLDER,
                           repository_name=f"{stack}-worker", noncurrent_days=NONCURRENT_DAYS,
                           log_retention_days=14)
        stacks = self._stacks(session)
        settings = self.settings
        # Remember where the stack lives before creating it, so `teardown` can clean up a failed setup.
        settings.update(options=chosen, region=session.region, profile=merged["profile"],
                        endpoint_url=merged["endpoint_url"], stack_name=stack,
                        network={"vpc_cidr": plan.vpc_cidr, "azs": plan.azs})
        self.config.provider = self.name
        self.config.save()
        tags = {"petctl:stack": stack, "petctl:kind": "base"}
        stacks.create_or_update(stack, body, tags, "petctl base stack")
        outputs = stacks.outputs(stack)
        # The etcd host's boot script waits for this object (on a first setup it boots before it exists).
        if etcdbin.upload(session.client("s3"), outputs["BucketName"], etcd):
            self.progress(f"uploaded etcd ({etcd.version}, sha256 {etcd.sha256[:12]}...) to the bucket")
        from petctl import __version__

        settings.update(outputs=outputs, worker_ami=worker_ami, etcd_ami=etcd_ami, root_volume_gb=root_gb,
                        image=merged["image"] or f"{outputs['RepositoryUri']}:{__version__}",
                        etcd_endpoint=outputs["EtcdEndpoint"], ready=True)
        self.config.provider = self.name
        self.config.save()
        return dict(settings)

    def _network_plan(self, session: AwsSession, vpc_cidr: str, max_azs: int):
        """The base stack's AZs and CIDRs: chosen once, then reused from the settings, so a later `setup`
        (which re-renders the template) never moves a subnet that jobs and the etcd interface live in."""
        recorded = self.settings.get("network") or {}
        if recorded.get("azs") and recorded.get("vpc_cidr") == str(vpc_cidr):
            azs = list(recorded["azs"])
            if len(azs) != max_azs:
                self.progress(f"keeping the stack's {len(azs)} AZs ({', '.join(azs)}): max_azs applies to a "
                              "new stack only (teardown first to change it)")
            return plan_network(azs, vpc_cidr, len(azs))
        return plan_network(inventory.usable_azs(session), vpc_cidr, max_azs)

    def teardown(self, force: bool = False) -> None:
        """Delete the job stacks (only with force) and the base stack. The bucket is kept (checkpoints).

        Works after a failed setup too: all it needs is where the base stack was to be created."""
        if not self.settings.get("region"):
            raise NotSetUp("nothing to tear down on AWS: `petctl setup --provider aws` was never run")
        session = self._session()
        stacks = self._stacks(session)
        jobs = stacks.list_stacks("petctl:stack", self._base)
        jobs = [s for s in jobs if _tags(s).get("petctl:kind") == "job"]
        live = [s for s in jobs if not self._ended_stack(session, s)]  # ended jobs' stacks just go
        if live and not force:
            names = ", ".join(sorted(_tags(s).get("petctl:job", s["StackName"]) for s in live))
            raise JobExists(f"{len(live)} job(s) still exist ({names}): kill them first or pass --force")
        role = self.settings.get("outputs", {}).get("JobStackRoleArn", "")
        for job_stack in jobs:  # start every deletion first, then wait: they run in parallel
            stacks.start_delete(job_stack["StackName"], role)
        for job_stack in jobs:
            stacks.delete(job_stack["StackName"], f"job {_tags(job_stack).get('petctl:job')}")
        bucket = self.settings.get("outputs", {}).get("BucketName", "")
        stacks.delete(self._base, "petctl base stack")
        if bucket:
            self.progress(f"kept bucket s3://{bucket} (checkpoints and code); delete it yourself when done")
        self.settings.update(ready=False, outputs={}, network={})  # a new stack may choose other AZs
        self.config.save()

    # --- jobs --------------------------------------------------------------------------------------
    def create_job(self, spec: JobSpec, script: Path) -> JobInfo:
        settings = self._ready()
        spec.validate()
        spec.instance_types = validate_instance_types([t for item in spec.instance_types
                                                       for t in item.split(",")])
        check_uniform_gpus(spec.instance_types, spec.nproc_per_node)
        if spec.spot_strategy not in SPOT_STRATEGIES:
            raise ValidationError(f"unknown spot allocation strategy {spec.spot_strategy!r}: choose "
                                  f"{' or '.join(SPOT_STRATEGIES)}")
        if not 0 <= spec.on_demand_base <= spec.max_size:
            raise ValidationError(f"--on-demand-base {spec.on_demand_base} is outside "
                                  f"[0, --max {spec.max_size}]")
        script = Path(script)
        if not script.exists():
            raise ValidationError(f"script {script} does not exist")
        if script.is_dir() and not spec.entrypoint:
            raise ValidationError(f"{script} is a directory: pass --entrypoint (the file to run inside it)")
        session = self._session()
        stacks = self._stacks(session)
        stack = self._job_stack(spec.name)
        inventory.check_image(session.client("ecr"), settings["image"], session.region)
        if stacks.describe(stack):
            raise JobExists(f"job {spec.name!r} already exists (stack {stack}): kill_job it or pick "
                            "another name")
        role = self._stack_role()
        self._check_quota(session, spec)
        store = self._store(session, spec.name)
        spec.code_url, default_entry = store.upload_code(script)
        spec.entrypoint = spec.entrypoint or default_entry
        spec.checkpoint_url = spec.checkpoint_url or store.url("checkpoints")
        spec.etcd_endpoint = settings["outputs"]["EtcdEndpoint"]
        placement = self._plan_placement(session, spec)
        agent = AgentConfig(job=spec, node_id="", host_addr="", work_dir="/work", imds_endpoint=WORKER_IMDS,
                            asg_name=stack, lifecycle_hook=LIFECYCLE_HOOK, region=session.region,
                            status_url=store.url() + "/")  # the agent mirrors status/, events/, logs/
        store.put_json("job.json", spec.to_dict())
        store.put_json("agent.json", _json(agent.to_json()))
        store.put_json("placement.json", _json(placement.to_json()))
        body = self.render_job_template(spec, agent, store.url("agent.json"), placement.subnet_ids)
        try:
            tags = {"petctl:stack": self._base, "petctl:kind": "job", "petctl:job": spec.name}
            stacks.create(stack, body, tags, f"job {spec.name}", role_arn=role)
        except ProviderError:
            if (stacks.describe(stack) or {}).get("StackStatus") == "ROLLBACK_COMPLETE":
                stacks.delete(stack, f"failed job {spec.name}", role)  # free the name for a corrected retry
            raise
        # The group was created empty (a stack waits for its group's desired capacity): AZRebalance is
        # suspended first (no template property can), then the group is started and watched.
        autoscaling = session.client("autoscaling")
        capacity.suspend_processes(autoscaling, stack)
        inventory.start_group(autoscaling, stack, spec.min_size, spec.size)
        inventory.wait_in_service(autoscaling, stack, spec.size, self.wait_timeout, self.poll_interval,
                                  self.progress, on_short=self._fallback_poller(spec.name))
        return self.job(spec.name)

    def _plan_placement(self, session: AwsSession, spec: JobSpec) -> Placement:
        return azfallback.plan(session, self.settings["outputs"], spec, self.progress)

    def _fallback_poller(self, name: str) -> Callable[[int], None]:
        """fallback_az at each poll of run_job's wait, its failures reported but never fatal."""
        return azfallback.poller(lambda in_service: self.fallback_az(name, in_service), name, self.progress)

    def fallback_az(self, name: str, in_service: int | None = None) -> str | None:
        """Move the job's group to its next AZ if its newest launch failed for lack of capacity there
        (see azfallback.fall_back); returns the new AZ, or None when it stays."""
        session = self._session()
        return azfallback.fall_back(session, self._store(session, name), self._job_stack(name), name,
                                    in_service, self.progress)

    def _check_quota(self, session: AwsSession, spec: JobSpec) -> None:
        """Refuse (one line, nothing created) a job none of whose instances fits the vCPU quota; warn when
        the quota cannot be read (an emulator, a missing permission) or leaves --size out of reach."""
        from petctl.providers.aws.quotas import check

        verdict = check(session, spec.instance_types, "on-demand" if spec.on_demand else "spot", spec.size)
        for warning in verdict.warnings:
            self.progress(f"warning: {warning}")
        if verdict.error:
            raise ProviderError(verdict.error)

    def render_job_template(self, spec: JobSpec, agent: AgentConfig, config_url: str,
                            subnet_ids: list[str] | None = None) -> str:
        """The job stack's template (public so tests can read exactly what would be deployed).

        `subnet_ids`: where the group launches (create_job passes its placement's); by default the
        first subnet, or every subnet for a --multi-az job."""
        settings = self._ready()
        out = settings["outputs"]
        types = spec.instance_types
        spot = not spec.on_demand
        mixed = len(types) > 1 or (spot and spec.on_demand_base > 0)
        user_data = worker_user_data(agent, image=settings["image"], log_group=out["LogGroupName"],
                                     config_url=config_url, gpus=is_gpu(types[0]))
        all_subnets = out["SubnetIds"].split(",")
        if subnet_ids is None:
            subnet_ids = all_subnets if spec.multi_az else all_subnets[:1]
        base = {"stack_name": self._base, "bucket": out["BucketName"], "subnet_ids": subnet_ids,
                "worker_security_group": out["WorkerSecurityGroupId"],
                "worker_policy_arn": out["WorkerPolicyArn"]}
        return render_job(job=spec, base=base, asg_name=agent.asg_name, ami=settings["worker_ami"],
                          instance_types=types, spot=spot, mixed=mixed, market_options=spot and not mixed,
                          on_demand_base=spec.on_demand_base, user_data=user_data,
                          spot_strategy=spec.spot_strategy,
                          job_prefix=job_prefix(spec.name),
                          lifecycle_hook=LIFECYCLE_HOOK, root_volume_gb=settings.get("root_volume_gb", 100),
                          hook_timeout=max(30, min(7200, int(spec.timeouts.preempt_deadline) + 60)))

    def kill_job(self, name: str) -> None:
        """Delete the job's stack (its Auto Scaling group and role); its S3 prefix stays (checkpoints)."""
        self._ready()
        session = self._session()
        stacks = self._stacks(session)
        store = self._store(session, name)
        if not stacks.describe(self._job_stack(name)):
            result = store.get_json("result.json")
            if inventory.ended(result):  # ended, and its stack already deleted: nothing left to remove
                self.progress(f"job {name} already ended ({result['state']}); its capacity is gone")
                return
            raise JobNotFound(f"no job {name!r} (see `petctl jobs`)")
        if store.get_json("result.json") is None:  # an ended job keeps the result its agent wrote
            info = self.job(name)
            ended = info.state in ("succeeded", "failed")
            store.put_json("result.json", {"job": name, "state": info.state if ended else "killed",
                                           "reason": info.reason if ended else "petctl kill_job",
                                           "ts": time.time()})
        stacks.delete(self._job_stack(name), f"job {name}", self._stack_role())

    def _ended_stack(self, session: AwsSession, stack: dict[str, Any]) -> bool:
        job = _tags(stack).get("petctl:job", "")
        return bool(job) and bool(self.settings.get("outputs", {}).get("BucketName")) and inventory.ended(
            self._store(session, job).get_json("result.json"))

    def scale(self, name: str, size: int) -> None:
        self._ready()
        session = self._session()
        group = inventory.group(session.client("autoscaling"), self._job_stack(name), name)
        if not group["MinSize"] <= size <= group["MaxSize"]:
            raise ValidationError(f"size {size} is outside the job's [min {group['MinSize']}, "
                                  f"max {group['MaxSize']}]")
        with aws_errors(f"scale job {name}"):
            session.client("autoscaling").set_desired_capacity(AutoScalingGroupName=self._job_stack(name),
                                                               DesiredCapacity=size, HonorCooldown=False)

    def hosts(self, name: str) -> list[HostInfo]:
        self._ready()
        session = self._session()
        self.job(name)  # JobNotFound for an unknown job
        return inventory.hosts(session.client("ec2"), self._base, name)

    def terminate_host(self, name: str, host_id: str | None, mode: str = "kill", grace: float = 0.0) -> str:
        """Terminate one instance through EC2 (as a reclaim would); the group launches a replacement."""
        if mode != "kill":
            raise ProviderError(f"terminate mode {mode!r} is not supported on aws: only 'kill' "
                                "(EC2 terminate-instances)")
        live = [h for h in self.hosts(name) if h.state in ("pending", "running")]
        if host_id is None:
            if not live:
                raise ProviderError(f"job {name!r} has no running instance to terminate")
            host_id = sorted(live, key=lambda h: (h.launched_at or 0, h.host_id))[-1].host_id
        elif host_id not in {h.host_id for h in self.hosts(name)}:
            raise ProviderError(f"no instance {host_id!r} in job {name!r} (see `petctl hosts {name}`)")
        session = self._session()
        with aws_errors(f"terminate instance {host_id}"):
            session.client("ec2").terminate_instances(InstanceIds=[host_id])
        return host_id

    def jobs(self) -> list[JobInfo]:
        """Jobs with a stack, and finished ones whose stack is gone (from their S3 record)."""
        settings = self._ready()
        session = self._session()
        stacks = [s for s in self._stacks(session).list_stacks("petctl:stack", self._base)
                  if _tags(s).get("petctl:kind") == "job"]
        infos = []
        for stack in stacks:
            info = inventory.job_info(session.client("autoscaling"), stack, self.name)
            result = self._store(session, info.name).get_json("result.json")
            infos.append(inventory.apply_result(info, result))
            self._reap(session, stack, result)
        live = {i.name for i in infos}
        for name in recorded_jobs(session.client("s3"), settings["outputs"]["BucketName"]):
            if name not in live:
                info = self._recorded_job(session, name)
                if info is not None:
                    infos.append(info)
        return sorted(infos, key=lambda i: i.created_at)

    def _recorded_job(self, session, name: str) -> JobInfo | None:
        record = self._store(session, name).record()
        if record is None:
            return None
        spec, result = record["spec"], record["result"] or {}
        return JobInfo(name=name, state=result.get("state", "ended"), min_size=spec.get("min_size", 0),
                       max_size=spec.get("max_size", 0), desired=0, created_at=record["created_at"],
                       provider=self.name, reason=result.get("reason", "its stack is gone"),
                       extra={"stack": None, "ended_at": result.get("ts")})

    def cost(self, name: str, events: list[dict[str, Any]], now: float | None = None):
        """Spot and on-demand hours priced from AWS's published prices (cached a day, see pricing.py)."""
        from petctl.cost import price_usage, usage
        from petctl.providers.aws.pricing import PRICING_REGION, AwsPrices

        session = self._session()
        prices = AwsPrices(session.client("ec2"), session.client("pricing", region=PRICING_REGION),
                           session.region, self.config.home / "cache" / "aws-prices.json")
        return price_usage(usage(events, now), prices)

    def mirror_url(self, name: str) -> str:
        return self._store(self._session(), name).url() + "/"

    def job_events(self, name: str) -> list[dict[str, Any]]:
        """The agents' mirrored events, read with this provider's session (its region, profile and
        endpoint, which a bare boto3 client would not know), plus etcd's copy if etcd answers here."""
        from petctl.timeline import read_events

        events = self._store(self._session(), name).events()
        endpoint = self.etcd_endpoint()
        if inventory.etcd_answers(endpoint, timeout=1.0):
            events += read_events(name, endpoint, "")
        unique = {(e.get("ts"), e.get("node"), e.get("event")): e for e in events}
        return sorted(unique.values(), key=lambda e: float(e.get("ts", 0.0)))

    def job(self, name: str) -> JobInfo:
        self._ready()
        session = self._session()
        stack = self._stacks(session).describe(self._job_stack(name))
        if not stack or stack["StackStatus"] == "DELETE_COMPLETE":
            recorded = self._recorded_job(session, name)
            if recorded is None:
                raise JobNotFound(f"no job {name!r} (see `petctl jobs`)")
            return recorded
        info = inventory.job_info(session.client("autoscaling"), stack, self.name)
        result = self._store(session, name).get_json("result.json")
        self._reap(session, stack, result)
        return inventory.apply_result(info, result)

    def doctor(self):
        """`petctl doctor`: credentials, base stack, quotas, AMI, image, permissions (see doctor.py)."""
        from petctl.providers.aws.doctor import run_checks

        return run_checks(self._session(), self.settings, self._base)

    def scaling_activities(self, name: str) -> list[str]:
        """The group's latest scaling activities, explained (why instances are not launching)."""
        from petctl.providers.aws import activities

        self._ready()
        session = self._session()
        if not self._stacks(session).describe(self._job_stack(name)):
            return []
        return [activities.explain(a) for a in activities.recent(session.client("autoscaling"),
                                                                 self._job_stack(name), limit=5)]

    def etcd_endpoint(self) -> str:
        return self._ready()["outputs"]["EtcdEndpoint"]

    def node_states(self, name: str):
        """etcd when the CLI can reach it (a VPN, or inside the VPC); otherwise the agents' S3 mirror."""
        endpoint = self.etcd_endpoint()
        if inventory.etcd_answers(endpoint, timeout=1.0):
            return super().node_states(name)
        self.job(name)
        store = self._store(self._session(), name)
        return inventory.job_state_from_nodes(name, store.node_states(), store.get_json("result.json"))

    def logs(self, name: str, node: str | None = None, follow: bool = False) -> Iterator[str]:
        """Node logs from the job's S3 prefix; they outlive the job's stack (kill_job keeps them)."""
        self._ready()
        store = self._store(self._session(), name)
        available = store.log_nodes()
        if not available:
            self.job(name)  # JobNotFound for a job that never existed
        if node and node not in available:
            raise ProviderError(f"no log for node {node!r} in job {name!r} yet (see `petctl hosts {name}`)")
        def running() -> bool:
            return self.job(name).state == "running"

        yield from follow_logs(store, node, available, follow, running, max(self.poll_interval, 2.0))


def _tags(stack: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in stack.get("Tags", [])}


def _json(text: str) -> Any:
    import json

    return json.loads(text)


def _int_option(name: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValidationError(f"aws setup option {name} expects an integer (got {value!r})") from None
    if number < minimum:
        raise ValidationError(f"aws setup option {name} must be >= {minimum} (got {number})")
    return number
