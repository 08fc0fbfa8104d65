"""Starting a job on AWS: everything `run_job` checks and creates, in the order that keeps a refused job
from leaving anything behind.

Input is validated first with no AWS call (the submission, the instance types, the requirements file);
then what AWS must confirm (an --image's platform, the AMI, the job's name, the vCPU quota) is asked; only
then are the code, petctl's wheel, the job's records, its workers' boot script and its stack's template
uploaded, its stack created (by TemplateURL), and its group raised and watched until EC2 launched it.

Two ways to boot (JobBoot): by default the Deep Learning AMI, whose Python gets the petctl that launched
the job; with --image, that container on the ECS GPU AMI (both in boot.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from petctl.core.errors import JobExists, NotSetUp, PetctlError, ProviderError, ValidationError
from petctl.core.spec import AgentConfig, JobSpec, JobSubmission
from petctl.io.aws import AwsSession
from petctl.providers.aws import basestack, capacity, etcdsecrets, inventory
from petctl.providers.aws.boot import (
    AMI_PYTHON,
    WHEEL_DIR,
    WORKER_IMDS,
    AmiBoot,
    build_wheel,
    check_image,
    read_requirements,
    resolve,
    worker_boot_script,
    worker_user_data,
)
from petctl.providers.aws.capacity import (
    capacity_rebalance,
    check_uniform_gpus,
    is_gpu,
    validate_instance_types,
)
from petctl.providers.aws.etcdbin import BootScript
from petctl.providers.aws.jobscope import template_scope
from petctl.providers.aws.stacks import publish, template_key
from petctl.providers.aws.storage import JobStore
from petctl.providers.aws.templates import render_job

if TYPE_CHECKING:
    from petctl.providers.aws.context import AwsContext

LIFECYCLE_HOOK = "petctl-drain"
# The launch hook (cfn/job.yaml.j2): an instance is InService only once its agent joined the rendezvous
# and completed it; one that does not within `Timeouts.boot_timeout` is abandoned (terminated).
LAUNCH_HOOK = "petctl-boot"
HOOK_TIMEOUT_RANGE = (30, 7200)  # AWS: a lifecycle hook's HeartbeatTimeout, in seconds
WORK_DIRS = {True: "/work", False: "/var/lib/petctl/work"}  # container (bind mount) / AMI path


@dataclass(frozen=True)
class JobBoot:
    """How the job's instances boot: `ami`, and either `image` (a container) or `ami_boot` (petctl's
    wheel into the AMI's Python)."""

    ami: str
    image: str = ""
    ami_boot: AmiBoot | None = None
    root_volume_gb: int = 0  # 0: setup's root_volume_gb
    root_device: str = "/dev/xvda"


def validate(provider: AwsContext, job: JobSubmission) -> JobSpec:
    """The submission and its instance types checked, with no AWS call. Raises ValidationError."""
    provider.validate(job)
    spec = job.spec
    types = [t for item in spec.instance_types for t in item.split(",")]
    spec.instance_types = validate_instance_types(types)
    check_uniform_gpus(spec.instance_types, spec.nproc_per_node)
    low, high = HOOK_TIMEOUT_RANGE
    if not low <= spec.timeouts.boot_timeout <= high:
        raise ValidationError(f"boot_timeout must be within [{low}, {high}] seconds (an Auto Scaling "
                              f"lifecycle hook's range; got {spec.timeouts.boot_timeout:g})")
    return spec


def create_job(provider: AwsContext, job: JobSubmission) -> None:
    """Create the job's stack and start its group; returns once EC2 launched `size` instances (or
    `provider.wait_timeout` passed: a spot shortage is reported, not fatal). Whether they boot and join
    is `run_job --wait`'s to follow (AwsProvider.wait_joined)."""
    settings = provider.require_ready()
    spec = validate(provider, job)
    image = job.image or settings.get("image", "")
    requirements = read_requirements(job.requirements)
    if image and requirements:
        raise ValidationError("--requirements is for the default (Deep Learning AMI) boot: with --image, "
                              "install them in your image")
    if not image and (settings.get("network") or {}).get("subnets") == "private":
        raise ValidationError("private subnets cannot reach the package index the default boot installs "
                              "petctl's dependencies from: pass --image (an image with petctl, docs/aws.md)")
    session = provider.session()
    stacks = provider.stacks(session)
    stack = provider.job_stack(spec.name)
    if image:
        check_image(session.client("ecr"), image, session.region)
    ami = resolve(session.client("ssm"), session.client("ec2"), settings, container=bool(image))
    provider.progress(f"worker AMI {ami.summary()}" + (f"; image {image}" if image else ""))
    if stacks.describe(stack):
        raise JobExists(f"job {spec.name!r} already exists (stack {stack}): kill_job it or pick another name")
    role = provider.stack_role()
    job_boundary(settings["outputs"])  # before anything is created
    check_quota(provider, session, spec)
    if (warning := basestack.etcd_host_warning(settings, spec.max_size)) is not None:
        provider.progress(f"warning: {warning}")
    store = provider.store(session, spec.name)
    spec.code_url, _ = store.upload_code(job.script)
    root = {"root_volume_gb": ami.root_volume_gb(int(settings.get("root_volume_gb", 100))),
            "root_device": ami.root_device}
    if image:
        boot = JobBoot(ami.image_id, image, **root)
    else:
        wheelhouse = upload_wheelhouse(store, requirements, provider.progress)
        boot = JobBoot(ami.image_id, ami_boot=wheelhouse, **root)
    spec.checkpoint_url = spec.checkpoint_url or store.url("checkpoints")
    spec.etcd_endpoint = settings["outputs"]["EtcdEndpoint"]
    # The API the stack's etcd serves (setup's `store`: etcd 3.6 serves v3 only): agents and readers alike.
    spec.etcd_store = basestack.stack_store(settings, "")
    placement = capacity.plan(session, settings["outputs"], spec, provider.progress)
    # This run's etcd user: its certificate in a secret only the job's instances may read, the user
    # indexed in the bucket for the etcd hosts (etcdsecrets.py). The spec names the secret, not its value.
    secrets, s3 = session.client("secretsmanager"), session.client("s3")
    bucket = settings["outputs"]["BucketName"]
    spec.etcd_credentials, _ = etcdsecrets.create_job_credentials(secrets, s3, bucket, provider.base_stack,
                                                                  spec.name)
    agent = AgentConfig(job=spec, node_id="", host_addr="", work_dir=WORK_DIRS[bool(image)],
                        imds_endpoint=WORKER_IMDS, asg_name=stack, lifecycle_hook=LIFECYCLE_HOOK,
                        launch_hook=LAUNCH_HOOK,
                        region=session.region,
                        status_url=store.url() + "/")  # the agent mirrors status/, events/, logs/
    try:  # from here on a failure deletes the credentials again: no secret outlives a job not started
        store.put_json("job.json", spec.to_dict())
        store.put_json("agent.json", json.loads(agent.to_json()))
        store.put_json("placement.json", json.loads(placement.to_json()))
        # The workers' boot script and the stack's template go to the job's prefix first: the user data
        # fetches the one, CloudFormation the other (a TemplateURL: no template outgrows a TemplateBody).
        script = job_boot_script(provider, agent, store.url("agent.json"), boot)
        upload_boot_script(s3, bucket, script)
        body = render_job_template(provider, spec, agent, store.url("agent.json"), placement.subnet_ids, boot,
                                   script)
        template = publish(s3, bucket, session.region, template_key(store.prefix, "template", body), body)
        tags = {"petctl:stack": provider.base_stack, "petctl:kind": "job", "petctl:job": spec.name,
                **basestack.layout_tags()}
        stacks.create(stack, template, tags, f"job {spec.name}", role_arn=role)
    except PetctlError:
        if (stacks.describe(stack) or {}).get("StackStatus") == "ROLLBACK_COMPLETE":
            stacks.delete(stack, f"failed job {spec.name}", role)  # free the name for a corrected retry
        etcdsecrets.delete_job_credentials(secrets, s3, bucket, provider.base_stack, spec.name)
        raise
    # The group was created empty (a stack waits for its group's desired capacity): AZRebalance is
    # suspended first (no template property can), then the group is started and watched.
    autoscaling = session.client("autoscaling")
    capacity.suspend_processes(autoscaling, stack)
    inventory.start_group(autoscaling, stack, spec.min_size, spec.size)
    inventory.wait_launched(autoscaling, stack, spec.size, provider.wait_timeout, provider.poll_interval,
                            provider.progress, on_short=provider.fallback_poller(spec.name))


def job_boundary(outputs: dict[str, str]) -> str:
    """The job roles' permissions boundary (the base stack's JobBoundary). Raises NotSetUp for a base stack
    from before it: its service role would refuse a bounded role, so setup must run again first."""
    if not outputs.get("JobBoundaryArn"):
        raise NotSetUp("the base stack predates the job roles' permissions boundary: run `petctl setup "
                       "--provider aws` again (it updates the stack), then run the job")
    return outputs["JobBoundaryArn"]


def check_quota(provider: AwsContext, session: AwsSession, spec: JobSpec) -> None:
    """Refuse (one line, nothing created) a job none of whose instances fits the vCPU quota; warn when
    the quota cannot be read (an emulator, a missing permission) or leaves --size out of reach."""
    verdict = capacity.check(session, spec.instance_types, "on-demand" if spec.on_demand else "spot",
                             spec.size)
    for warning in verdict.warnings:
        provider.progress(f"warning: {warning}")
    if verdict.error:
        raise ProviderError(verdict.error)


def upload_wheelhouse(store: JobStore, requirements: str, progress) -> AmiBoot:
    """The launching petctl's wheel (and the job's requirements) in the job's prefix, for its instances."""
    from petctl.io.aws import aws_errors

    wheel = build_wheel()
    key = f"{WHEEL_DIR}/{wheel.name}"
    with aws_errors(f"upload petctl's wheel to {store.url(key)}"):
        store.objects.put_bytes(key, wheel.data)
        if requirements:
            store.objects.put_bytes(f"{WHEEL_DIR}/requirements.txt", requirements.encode())
    progress(f"uploaded petctl {wheel.version} ({len(wheel.data) // 1024} KB) for the instances to install")
    listed = store.url(WHEEL_DIR, "requirements.txt") if requirements else ""
    return AmiBoot(wheel_url=store.url(key), requirements_url=listed,
                   python_bin=AMI_PYTHON.rsplit("/", 1)[0])


def job_boot_script(provider: AwsContext, agent: AgentConfig, config_url: str,
                    boot: JobBoot | None = None) -> BootScript:
    """The job's workers' boot script (boot.worker_boot_script), for the job's prefix. `boot`: how its
    instances boot (by default the recorded `worker_ami` and `image` settings)."""
    settings = provider.require_ready()
    boot = boot or JobBoot(ami=settings["worker_ami"], image=settings["image"])
    return worker_boot_script(agent, image=boot.image, log_group=settings["outputs"]["LogGroupName"],
                              config_url=config_url, gpus=is_gpu(agent.job.instance_types[0]),
                              ami_boot=boot.ami_boot)


def upload_boot_script(s3: Any, bucket: str, script: BootScript) -> None:
    """Put the workers' boot script at its key (its name carries its checksum). Raises ProviderError (one
    line) when the upload fails."""
    from petctl.io.aws import aws_errors

    with aws_errors(f"upload the workers' boot script to s3://{bucket}/{script.key}"):
        s3.put_object(Bucket=bucket, Key=script.key, Body=script.text.encode(),
                      ContentType="text/x-shellscript", Metadata={"sha256": script.sha256})


def render_job_template(provider: AwsContext, spec: JobSpec, agent: AgentConfig, config_url: str,
                        subnet_ids: list[str] | None = None, boot: JobBoot | None = None,
                        script: BootScript | None = None) -> str:
    """The job stack's template. `subnet_ids`: where the group launches (create_job passes its
    placement's); by default the first subnet, or every subnet for a --multi-az job. `boot`: how its
    instances boot (by default the recorded `worker_ami` and `image` settings). `script`: the boot script
    its user data fetches (by default job_boot_script's)."""
    settings = provider.require_ready()
    boot = boot or JobBoot(ami=settings["worker_ami"], image=settings["image"])
    out = settings["outputs"]
    types = spec.instance_types
    spot = not spec.on_demand
    mixed = len(types) > 1 or (spot and spec.on_demand_base > 0)
    script = script or job_boot_script(provider, agent, config_url, boot)
    user_data = worker_user_data(script, out["BucketName"])
    all_subnets = out["SubnetIds"].split(",")
    if subnet_ids is None:
        subnet_ids = all_subnets if spec.multi_az else all_subnets[:1]
    base = {"stack_name": provider.base_stack, "bucket": out["BucketName"], "subnet_ids": subnet_ids,
            "vpc_id": out["VpcId"], "etcd_security_group": out["EtcdSecurityGroupId"],
            "worker_policy_arn": out["WorkerPolicyArn"], "boundary_arn": job_boundary(out)}
    return render_job(job=spec, base=base, asg_name=agent.asg_name, ami=boot.ami,
                      instance_types=types, spot=spot, mixed=mixed, market_options=spot and not mixed,
                      capacity_rebalance=capacity_rebalance(spot, types, spec.multi_az),
                      on_demand_base=spec.on_demand_base, user_data=user_data,
                      spot_strategy=spec.spot_strategy, lifecycle_hook=LIFECYCLE_HOOK,
                      launch_hook=LAUNCH_HOOK, boot_timeout=int(spec.timeouts.boot_timeout),
                      **template_scope(provider.base_stack, spec.name, agent.asg_name, out["LogGroupName"]),
                      etcd_secret_arn=spec.etcd_credentials,
                      root_volume_gb=boot.root_volume_gb or settings.get("root_volume_gb", 100),
                      root_device=boot.root_device,
                      hook_timeout=max(30, min(7200, int(spec.timeouts.save_deadline) + 60)))
