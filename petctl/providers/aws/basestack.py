"""The installation's base stack: `petctl setup --provider aws` creates or updates it, `teardown`
deletes it (and, with --force, the job stacks under it), and an update waits until no job stack of an
older layout is left under it.

The base stack holds what every job shares: the VPC and its subnets (one per AZ), the etcd host, the
bucket, the worker image repository, the log group, the workers' policy and the service role that
creates and deletes job stacks.

How the stack is made: a new stack is created from a seed template (the bucket alone, small enough to go
inline); setup then uploads etcd's files and the full template to that bucket and updates the stack from
the template's URL (it outgrows CloudFormation's 51,200-byte TemplateBody). An existing stack is updated
from the URL directly (stacks.py says who reads it).

Why an update may be refused: since issue 17 every job's IAM role and instance profile live under the
job's own IAM path (`/petctl/<stack>/<job>/`, jobscope.py), and the base stack's CloudFormation service
role, which creates and deletes job stacks, may touch only roles under `/petctl/<stack>/`. A job stack
created by an earlier petctl has its role at path `/`: once the base stack is updated, that service role
is denied `iam:DeleteRole` on it, so `kill_job` would leave the stack in DELETE_FAILED and the job's
instances running. So `setup` refuses the update while such a job stack exists and says which to kill
first, while the old service role can still delete them; nothing is changed before that check. Since
issue 24 every job role also has the base stack's JobBoundary as its permissions boundary, and the
service role may change a role's policies (DeleteRolePolicy, DetachRolePolicy: what deleting a job stack
does) only on a role with that boundary: a job stack from before it is refused the same way. Each job
stack records its layout in the `petctl:layout` tag (`layout_tags`); a stack without it predates the tag.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from petctl.core.errors import JobExists, NotSetUp, ProviderError, ValidationError
from petctl.core.store import JOB_DEFAULT_BACKEND, Backend
from petctl.io.aws import AwsSession, aws_errors
from petctl.providers.aws import etcdbin, etcdsecrets, inventory, jobrecords
from petctl.providers.aws.boot import BUCKET_PLACEHOLDER, etcd_hosts
from petctl.providers.aws.network import DEFAULT_VPC_CIDR, ETCD_NODE_CHOICES, SUBNET_KINDS, plan_network
from petctl.providers.aws.stacks import StackOps, Template, publish, template_key
from petctl.providers.aws.templates import render_base, render_seed

if TYPE_CHECKING:
    from petctl.providers.aws.context import AwsContext

STACK_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
ETCD_AMI_PARAM = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
TEMPLATE_PREFIX = "templates"  # the base stack's templates in its bucket (job stacks': their job's prefix)
NONCURRENT_DAYS = 1  # old object versions (status, checkpoints, mirror chunks) kept this long
SETUP_OPTIONS = {  # every option `setup` accepts, with its default
    "region": "", "profile": "", "endpoint_url": "", "stack_name": "petctl", "vpc_cidr": DEFAULT_VPC_CIDR,
    "max_azs": "3", "image": "", "worker_ami": "", "etcd_ami": "", "etcd_instance_type": "t3.small",
    "root_volume_gb": "100", "etcd_binary": "", "etcd_sha256": "", "etcdctl_sha256": "", "etcd_nodes": "1",
    "subnets": "public", "etcd_download_url": "", "store": "",  # store: "" is the stack's own (stack_store)
}

BURSTABLE_FAMILIES = ("t2.", "t3.", "t3a.", "t4g.")  # EC2's burstable instance families
# A cautious line, not a measured limit. At 64 nodes a job at rest cost etcd 0.94 ms of CPU per node a
# second on AWS's timeouts, and its whole reads of live/ grow with the job (bench/README.md, "What a job
# at rest costs etcd's CPU"); a t3.small's baseline is 0.4 vCPU. docs/aws.md, "Sizing the etcd host".
BURSTABLE_ETCD_NODES = 300


def etcd_host_warning(settings: dict[str, Any], max_nodes: int) -> str | None:
    """A warning for a job of `max_nodes` on this stack's etcd host, or None: a job of more than
    `BURSTABLE_ETCD_NODES` on a burstable host may keep etcd above the host's CPU baseline at rest, which
    AWS bills (unlimited mode) or throttles (standard mode). Pure: from the recorded setup options."""
    kind = {**SETUP_OPTIONS, **settings.get("options", {})}["etcd_instance_type"]
    if max_nodes <= BURSTABLE_ETCD_NODES or not kind.startswith(BURSTABLE_FAMILIES):
        return None
    return (f"a job of up to {max_nodes} nodes on a burstable etcd host ({kind}) may keep etcd above the "
            "host's CPU baseline even at rest; for such jobs run `petctl setup --provider aws --option "
            "etcd_instance_type=c7i.large` (docs/aws.md, \"Sizing the etcd host\")")


def chosen_options(settings: dict[str, Any], options: dict[str, Any]) -> dict[str, str]:
    """The options the user chose, now and at earlier setups (strings, as `--option KEY=VALUE` gives
    them). What was derived (AMIs, image) is not remembered, so a later `setup` picks up AWS's current
    AMIs unless the user pinned them. Raises ValidationError for an unknown option."""
    opts = {k.replace("-", "_"): str(v) for k, v in options.items() if v not in (None, "")}
    opts.pop("provider", None)
    unknown = sorted(set(opts) - set(SETUP_OPTIONS))
    if unknown:
        raise ValidationError(f"unknown aws setup option(s) {', '.join(unknown)}: choose from "
                              f"{', '.join(SETUP_OPTIONS)}")
    return {**settings.get("options", {}), **opts}


def setup(provider: AwsContext, options: dict[str, Any]) -> dict[str, Any]:
    """Create or update the base stack; returns the settings recorded in the config. Options: region,
    profile, endpoint_url, stack_name, vpc_cidr, max_azs, image, worker_ami, etcd_ami,
    etcd_instance_type, root_volume_gb, etcd_binary (with etcd_sha256, etcdctl_sha256), etcd_download_url
    (a mirror of etcd's releases), etcd_nodes (1 or 3), subnets (public or private), store (v3 or v2: the
    etcd API the jobs use, and so the etcd the stack runs; see stack_store)."""
    chosen = chosen_options(provider.settings, options)
    merged = {**SETUP_OPTIONS, **chosen}
    if not STACK_NAME_RE.match(merged["stack_name"]):
        raise ValidationError(f"invalid stack_name {merged['stack_name']!r}: 1-24 lowercase letters, "
                              "digits and '-', starting with a letter")
    max_azs = _int_option("max_azs", merged["max_azs"], 2)
    root_gb = _int_option("root_volume_gb", merged["root_volume_gb"], 30)
    etcd_nodes = _etcd_nodes(provider, merged["etcd_nodes"])
    private = _subnets(provider, merged["subnets"]) == "private"
    store = stack_store(provider.settings, merged["store"])
    session = provider.session(merged)
    with aws_errors("check the AWS credentials"):
        session.client("sts").get_caller_identity()
    stack = merged["stack_name"]
    plan = network_plan(provider, session, merged["vpc_cidr"], max_azs, etcd_nodes, private)
    if plan.etcd_cluster and plan.etcd_azs < len(plan.etcd_members):
        provider.progress(f"the stack has {len(plan.subnets)} AZs: {len(plan.etcd_members)} etcd members in "
                          f"{plan.etcd_azs} AZs survive losing any one member, not losing a whole AZ")
    # the pinned etcd release, downloaded and verified here (or the operator's etcd_binary): before any
    # change to the account, so a bad checksum leaves nothing behind
    etcd = etcdbin.setup_etcd(merged, provider.config.home / "cache" / "etcd", store)
    ssm = session.client("ssm")
    etcd_ami = merged["etcd_ami"] or inventory.ssm_parameter(ssm, ETCD_AMI_PARAM)
    # The workers' AMI is resolved by each run_job (boot.resolve: the Deep Learning AMI, or the ECS GPU AMI
    # for an --image job), so every job boots AWS's current one unless the user pinned worker_ami.
    hosts, boot_script = etcd_hosts(stack, plan, etcd, store)
    body = render_base(stack_name=stack, plan=plan, etcd_ami=etcd_ami,
                       etcd_instance_type=merged["etcd_instance_type"], etcd_members=hosts,
                       bucket_placeholder=BUCKET_PLACEHOLDER,
                       repository_name=f"{stack}-worker", noncurrent_days=NONCURRENT_DAYS,
                       log_retention_days=14)
    stacks = provider.stacks(session)
    check_upgrade(jobrecords.job_stacks(stacks, stack))
    settings = provider.settings
    # Remember where the stack lives before creating it, so `teardown` can clean up a failed setup.
    settings.update(options=chosen, region=session.region, profile=merged["profile"],
                    endpoint_url=merged["endpoint_url"], stack_name=stack, store=store,
                    network={"vpc_cidr": plan.vpc_cidr, "azs": plan.azs, "etcd_nodes": etcd_nodes,
                             "subnets": "private" if plan.private else "public"})
    provider.config.provider = provider.name
    provider.config.save()
    # etcd's certificates, before the etcd hosts boot and look for theirs (etcdsecrets.py).
    if etcdsecrets.ensure_installation(session.client("secretsmanager"), stack,
                                       tuple(m.ip for m in plan.etcd_members)):
        provider.progress(f"created etcd's certificates (secrets {etcdsecrets.prefix(stack)}/...)")
    tags = {"petctl:stack": stack, "petctl:kind": "base"}
    s3 = session.client("s3")
    bucket = ensure_bucket(stacks, stack, Template(body=render_seed(stack_name=stack,
                                                                    noncurrent_days=NONCURRENT_DAYS)), tags)
    # etcd's files before the hosts that fetch them exist, then the full template, by URL from the bucket.
    if etcdbin.upload(s3, bucket, etcd, boot_script):
        provider.progress(f"uploaded etcd ({etcd.version}, sha256 {etcd.sha256[:12]}...) to the bucket")
    template = publish(s3, bucket, session.region, template_key(TEMPLATE_PREFIX, "base", body), body)
    stacks.create_or_update(stack, template, tags, "petctl base stack")
    outputs = stacks.outputs(stack)
    settings.update(outputs=outputs, worker_ami=merged["worker_ami"], etcd_ami=etcd_ami,
                    root_volume_gb=root_gb, image=merged["image"],
                    etcd_endpoint=outputs["EtcdEndpoint"], ready=True)
    provider.config.provider = provider.name
    provider.config.save()
    return dict(settings)


def seed_needed(existing: dict[str, Any] | None) -> bool:
    """Whether the base stack must first be created from its seed (the bucket alone): when there is no
    stack, or only the empty remains of a first creation that failed (ROLLBACK_COMPLETE)."""
    return existing is None or existing.get("StackStatus") == "ROLLBACK_COMPLETE"


def ensure_bucket(stacks: StackOps, name: str, seed: Template, tags: dict[str, str]) -> str:
    """The base stack's bucket, creating the stack from `seed` when it has none yet (seed_needed). A stack
    that exists keeps its template until the full one replaces it. Raises ProviderError when the seed
    fails, or the stack has no bucket to show (it is busy: wait and retry), JobExists when it is busy."""
    if seed_needed(stacks.describe(name)):
        stacks.create_or_update(name, seed, tags, "petctl base stack's bucket")
    bucket = stacks.outputs(name).get("BucketName", "")
    if not bucket:
        status = (stacks.describe(name) or {}).get("StackStatus", "gone")
        raise ProviderError(f"stack {name} ({status}) has no bucket yet: wait for it to settle and run setup "
                            "again")
    return bucket


def network_plan(provider: AwsContext, session: AwsSession, vpc_cidr: str, max_azs: int,
                 etcd_nodes: int = 1, private: bool = False):
    """The base stack's AZs and CIDRs: chosen once, then reused from the settings, so a later `setup`
    (which re-renders the template) never moves a subnet that jobs and the etcd interfaces live in."""
    recorded = provider.settings.get("network") or {}
    if recorded.get("azs") and recorded.get("vpc_cidr") == str(vpc_cidr):
        azs = list(recorded["azs"])
        if len(azs) != max_azs:
            provider.progress(f"keeping the stack's {len(azs)} AZs ({', '.join(azs)}): max_azs applies to a "
                              "new stack only (teardown first to change it)")
        return plan_network(azs, vpc_cidr, len(azs), etcd_nodes, private)
    return plan_network(inventory.usable_azs(session), vpc_cidr, max_azs, etcd_nodes, private)


def _etcd_nodes(provider: AwsContext, value: str) -> int:
    """etcd_nodes as chosen: 1 or 3, and the existing stack's count (a running etcd is not converted
    between one host and a cluster in place). Raises ValidationError."""
    nodes = _int_option("etcd_nodes", value, 1)
    if nodes not in ETCD_NODE_CHOICES:
        raise ValidationError(f"--etcd-nodes must be 1 or 3 (got {nodes})")
    recorded = (provider.settings.get("network") or {}).get("etcd_nodes")
    if recorded and provider.settings.get("ready") and int(recorded) != nodes:
        raise ValidationError(f"the stack runs {recorded} etcd node(s): changing to {nodes} needs `petctl "
                              "teardown` first (etcd's data is not carried between the two layouts)")
    return nodes


def stack_store(settings: dict[str, Any], value: str) -> Backend:
    """The `store` a setup runs with: the one chosen (v3 or v2), else the ready stack's own, else v3
    (JOB_DEFAULT_BACKEND). The stack's own is the one its settings record; a ready stack that records none
    was set up before the option existed and runs etcd 3.5 with the v2 API: v2. A ready stack keeps its
    store: etcd's upgrade to 3.6 needs the v2 data (v2 auth, on a v2 stack) removed from the data dir
    first, which petctl does not automate (docs/aws.md), and its running jobs speak the API they started
    with. Raises ValidationError (one line) for another value or
    a change."""
    recorded = (settings.get("store") or "v2") if settings.get("ready") else ""
    store = etcdbin.store_option(value) if value else (recorded or JOB_DEFAULT_BACKEND)
    if settings.get("ready") and recorded and store != recorded:
        raise ValidationError(f"the stack runs store={recorded} (etcd {etcdbin.RELEASES[recorded].version}): "
                              f"changing to {store} needs `petctl teardown` first (the jobs and etcd's data "
                              "are not carried between the two)")
    return store


def _subnets(provider: AwsContext, value: str) -> str:
    """subnets as chosen: public or private, and the existing stack's kind (instances in public subnets
    have no route to the interface endpoints' replacement and the other way round: the change needs a
    new stack). Raises ValidationError."""
    if value not in SUBNET_KINDS:
        raise ValidationError(f"aws setup option subnets must be public or private (got {value!r})")
    recorded = (provider.settings.get("network") or {}).get("subnets", "public")
    if provider.settings.get("ready") and provider.settings.get("network") and recorded != value:
        raise ValidationError(f"the stack has {recorded} subnets: changing to {value} needs `petctl "
                              "teardown` first (running instances keep the addresses they launched with)")
    return value


def teardown(provider: AwsContext, force: bool) -> None:
    """Delete the job stacks (only with force) and the base stack. The bucket is kept (checkpoints).

    Works after a failed setup too: all it needs is where the base stack was to be created."""
    settings = provider.settings
    if not settings.get("region"):
        raise NotSetUp("nothing to tear down on AWS: `petctl setup --provider aws` was never run")
    session = provider.session()
    stacks = provider.stacks(session)
    jobs = jobrecords.job_stacks(stacks, provider.base_stack)
    live = [s for s in jobs if not jobrecords.ended_stack(provider, session, s)]  # ended ones just go
    if live and not force:
        names = ", ".join(sorted(jobrecords.tags(s).get("petctl:job", s["StackName"]) for s in live))
        raise JobExists(f"{len(live)} job(s) still exist ({names}): kill them first or pass --force")
    role = settings.get("outputs", {}).get("JobStackRoleArn", "")
    for job_stack in jobs:  # start every deletion first, then wait: they run in parallel
        stacks.start_delete(job_stack["StackName"], role)
    for job_stack in jobs:
        stacks.delete(job_stack["StackName"], f"job {jobrecords.tags(job_stack).get('petctl:job')}")
    bucket = settings.get("outputs", {}).get("BucketName", "")
    stacks.delete(provider.base_stack, "petctl base stack")
    # etcd's certificates go with the etcd they were for (a new setup makes new ones).
    etcdsecrets.delete(session.client("secretsmanager"), etcdsecrets.prefix(provider.base_stack) + "/")
    if bucket:
        etcdsecrets.unindex(session.client("s3"), bucket, etcdsecrets.USERS_INDEX)
        provider.progress(f"kept bucket s3://{bucket} (checkpoints and code); delete it yourself when done")
    settings.update(ready=False, outputs={}, network={})  # a new stack may choose other AZs
    provider.config.save()


def _int_option(name: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValidationError(f"aws setup option {name} expects an integer (got {value!r})") from None
    if number < minimum:
        raise ValidationError(f"aws setup option {name} must be >= {minimum} (got {number})")
    return number


LAYOUT_TAG = "petctl:layout"
# the job's role and profile under /petctl/<stack>/<job>/ (jobscope.py), the role bounded by JobBoundary
LAYOUT = "job-iam-boundary"


def layout_tags() -> dict[str, str]:
    """The tag every new job stack carries."""
    return {LAYOUT_TAG: LAYOUT}


def outdated_jobs(job_stacks: Iterable[dict[str, Any]]) -> list[str]:
    """The jobs (sorted names) whose stacks were made with another layout than this petctl's."""
    names = []
    for stack in job_stacks:
        tags = jobrecords.tags(stack)
        if tags.get(LAYOUT_TAG) != LAYOUT:
            names.append(tags.get("petctl:job", stack.get("StackName", "?")))
    return sorted(names)


def check_upgrade(job_stacks: Iterable[dict[str, Any]]) -> None:
    """Raises JobExists (one line, naming them) when a job stack of an older layout exists."""
    old = outdated_jobs(job_stacks)
    if old:
        raise JobExists(
            f"{len(old)} job(s) were started by an earlier petctl ({', '.join(old)}) whose IAM roles the "
            "updated base stack could no longer delete: kill them first (`petctl kill_job NAME`; "
            "checkpoints stay in the bucket), then run setup again")
