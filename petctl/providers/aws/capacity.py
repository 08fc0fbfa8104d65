"""A job's capacity: which instances it may ask for, whether the account's vCPU quota lets any of them
launch, which availability zone its group runs in, and the move to the next AZ when that one runs out.

What is asked is checked before anything is created. `--instance-types` against a local table (no API
call: a typo should cost a second, not a failed stack): the NVIDIA GPU families a training job would use
and the common CPU families, all x86_64 like the worker image and its AMI; a new family is one line. Then
the EC2 vCPU quotas the types draw on (Service Quotas, service `ec2`, codes as the EC2 documentation names
them): with the spot quota at 0, the default for GPU families on a new account, an Auto Scaling group can
never launch and nothing else would say why. A quota that cannot be read (an emulator, a missing
permission, an unknown code) is a warning, never a failure.

Why one AZ per job: DDP all-reduces every step, and data between AZs is billed $0.01/GB each way; for a
ResNet-50 pair that is roughly $15-45/h against under $1/h of spot compute. Within an AZ the traffic is
free. So a job's group gets one subnet, in an AZ where every requested instance type is offered, and moves
to the next AZ (by updating the group's VPCZoneIdentifier) when its scaling activities show that the chosen
AZ cannot supply the capacity; the move is recorded in the job's `placement.json` first, so the next
fallback skips the AZs already tried. Spreading a job over AZs stays possible (`run_job --multi-az`),
loudly warned.

The decisions (`validate_instance_types`, `assess`, `rank_azs`, `decide_fallback`, ...) are pure: records
in, verdicts out, tested without AWS. Beside them are the AWS calls (offerings by AZ, quotas, scaling
activities, moving the group, suspending the Auto Scaling processes that would fight a single-AZ training
job) and their wiring at run_job (`plan`, `poller`, `fall_back`), which the provider only connects to its
session, job store and progress output.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from petctl.core.errors import NotSetUp, ProviderError, ValidationError
from petctl.core.spec import JobSpec
from petctl.io.aws import AwsSession, aws_errors
from petctl.providers.aws import inventory
from petctl.providers.aws.inventory import launched
from petctl.providers.aws.storage import JobStore

GPU_FAMILIES = frozenset({
    "g4dn", "g5", "g6", "g6e", "gr6", "p3", "p3dn", "p4d", "p4de", "p5", "p5e", "p5en",
})
CPU_FAMILIES = frozenset({
    "t3", "t3a", "m5", "m5a", "m5n", "m6a", "m6i", "m6in", "m7a", "m7i",
    "c5", "c5a", "c5n", "c6a", "c6i", "c6in", "c7a", "c7i", "r5", "r5a", "r6a", "r6i", "r7a", "r7i",
})
KNOWN_FAMILIES = GPU_FAMILIES | CPU_FAMILIES


@dataclass(frozen=True)
class Gpus:
    """What one instance of a type offers a job: how many GPUs, of which model."""

    count: int
    model: str

    def __str__(self) -> str:
        return f"{self.count}x {self.model}"


_ONE_TO_16 = ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")
# family -> (model, {size: GPU count}); from AWS's accelerated-computing instance pages.
GPU_TABLE: dict[str, tuple[str, dict[str, int]]] = {
    "g4dn": ("T4", {**dict.fromkeys(_ONE_TO_16, 1), "12xlarge": 4, "metal": 8}),
    "g5": ("A10G", {**dict.fromkeys(_ONE_TO_16, 1), "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "g6": ("L4", {**dict.fromkeys(_ONE_TO_16, 1), "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "g6e": ("L40S", {**dict.fromkeys(_ONE_TO_16, 1), "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "gr6": ("L4", {"4xlarge": 1, "8xlarge": 1}),
    "p3": ("V100", {"2xlarge": 1, "8xlarge": 4, "16xlarge": 8}),
    "p3dn": ("V100 32GB", {"24xlarge": 8}),
    "p4d": ("A100 40GB", {"24xlarge": 8}),
    "p4de": ("A100 80GB", {"24xlarge": 8}),
    "p5": ("H100", {"4xlarge": 1, "48xlarge": 8}),
    "p5e": ("H200", {"48xlarge": 8}),
    "p5en": ("H200", {"48xlarge": 8}),
}
TYPE_RE = re.compile(r"^(?P<family>[a-z][a-z0-9-]*?)\.(?P<size>nano|micro|small|medium|large|xlarge|"
                     r"[1-9][0-9]*xlarge|metal(-[0-9]+xl)?)$")
DEFAULT_INSTANCE_TYPE = "g5.xlarge"


def validate_instance_types(types: list[str]) -> list[str]:
    """Return the types (default g5.xlarge when none given), deduplicated in order, or raise."""
    types = [t.strip() for t in types if t and t.strip()] or [DEFAULT_INSTANCE_TYPE]
    seen: list[str] = []
    for instance_type in types:
        match = TYPE_RE.match(instance_type)
        if not match:
            raise ValidationError(f"invalid instance type {instance_type!r}: expected FAMILY.SIZE such as "
                                  "g5.xlarge or p4d.24xlarge")
        if match.group("family") not in KNOWN_FAMILIES:
            raise ValidationError(f"unknown instance family {match.group('family')!r} in {instance_type!r}; "
                                  f"GPU families petctl knows: {', '.join(sorted(GPU_FAMILIES))}")
        if instance_type not in seen:
            seen.append(instance_type)
    if len({is_gpu(t) for t in seen}) > 1:
        raise ValidationError(f"--instance-types mixes GPU and CPU types ({', '.join(seen)}): a job's "
                              "instances must all have GPUs or none")
    return seen


def gpus(instance_type: str) -> Gpus:
    """GPU count and model of a GPU type; ValidationError for a size petctl does not know."""
    family, size = instance_type.split(".", 1)
    model, sizes = GPU_TABLE[family]
    if size not in sizes:
        raise ValidationError(f"unknown size {instance_type!r}: {family} comes as "
                              f"{', '.join(f'{family}.{s}' for s in sizes)}")
    return Gpus(sizes[size], model)


def check_uniform_gpus(types: list[str], nproc_per_node: int) -> Gpus | None:
    """Every node of a job runs `nproc_per_node` workers with one GPU each, and DDP wants the same GPU
    on every rank: mixed types must have the same GPU count and model. None for a CPU job."""
    if not is_gpu(types[0]):
        return None
    per_type = {t: gpus(t) for t in types}
    if len(set(per_type.values())) > 1:
        listed = ", ".join(f"{t} ({g})" for t, g in per_type.items())
        raise ValidationError(f"--instance-type values must have the same GPU count and model: {listed}")
    first = per_type[types[0]]
    if nproc_per_node > first.count:
        raise ValidationError(f"--nproc-per-node {nproc_per_node} exceeds the {first} of {types[0]}")
    return first


def is_gpu(instance_type: str) -> bool:
    return instance_type.split(".", 1)[0] in GPU_FAMILIES


QUOTAS = {  # market -> (quota code, name, instance-family pattern)
    "spot": (
        ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", r"[acdhimrtz]\d"),
        ("L-3819A6DF", "All G and VT Spot Instance Requests", r"(g|gr|vt)\d"),
        ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests", r"p[234]"),
        ("L-C4BD4855", "All P5 Spot Instance Requests", r"p5"),
    ),
    "on-demand": (
        ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", r"[acdhimrtz]\d"),
        ("L-DB2E81BA", "Running On-Demand G and VT instances", r"(g|gr|vt)\d"),
        ("L-417A185B", "Running On-Demand P instances", r"p\d"),
    ),
}


@dataclass(frozen=True)
class Quota:
    code: str
    name: str
    value: float | None  # vCPUs; None when it could not be read
    why_unknown: str = ""


@dataclass
class Verdict:
    """error: one line, set when no instance of the job can launch at all; warnings: the rest."""

    error: str = ""
    warnings: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # one per quota, for `petctl doctor`


def quota_for(instance_type: str, market: str) -> tuple[str, str] | None:
    """(code, name) of the vCPU quota an instance type draws on, or None for families not listed."""
    family = instance_type.split(".")[0]
    for code, name, pattern in QUOTAS[market]:
        if re.fullmatch(pattern + r"[a-z0-9-]*", family):
            return code, name
    return None


def assess(types: list[str], vcpus: dict[str, int], quotas: dict[str, Quota], market: str,
           size: int) -> Verdict:
    """Decide from known values only. Fails when *every* quota class the job could use is known and below
    one instance's vCPUs; warns when a quota is unknown or too small for --size instances."""
    verdict = Verdict()
    classes: dict[str, list[str]] = {}
    for t in types:
        found = quota_for(t, market)
        if found:
            classes.setdefault(found[0], []).append(t)
    blocked = []
    for code, members in classes.items():
        quota = quotas.get(code) or Quota(code, code, None, "not read")
        known = [t for t in members if t in vcpus]
        if quota.value is None or not known:
            why = quota.why_unknown or "the instance types' vCPUs are unknown"
            verdict.warnings.append(f"{market} vCPU quota {quota.code} ({quota.name}) not checked: {why}")
            verdict.lines.append(f"{quota.code} {quota.name}: unknown ({why})")
            continue
        smallest = min(known, key=lambda t: vcpus[t])
        need = vcpus[smallest]
        verdict.lines.append(f"{quota.code} {quota.name}: {quota.value:g} vCPUs "
                             f"(one {smallest} needs {need})")
        if quota.value < need:
            blocked.append(f"{quota.code} ({quota.name}) is {quota.value:g} vCPUs, below the {need} of one "
                           f"{smallest}")
        elif quota.value < need * size:
            verdict.warnings.append(f"{quota.code} ({quota.name}) is {quota.value:g} vCPUs: room for "
                                    f"{int(quota.value // need)} of the {size} {smallest} instances asked")
    if classes and len(blocked) == len(classes):
        verdict.error = (f"no instance of this job can launch: the {market} vCPU quota "
                         f"{'; '.join(blocked)}; request an increase in Service Quotas (nothing was created)")
    return verdict


def fetch_quota(servicequotas, code: str, name: str) -> Quota:
    """The account's applied value, or None with the reason it could not be read (never raises)."""
    from petctl.io.aws import BotoCoreError, ClientError, error_code, error_message

    try:
        value = servicequotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
        return Quota(code, name, float(value))
    except ClientError as exc:
        code_ = error_code(exc)
        if code_ in ("AccessDenied", "AccessDeniedException"):
            why = "not allowed to read it (servicequotas:GetServiceQuota)"
        elif code_ == "NoSuchResourceException":
            why = f"this endpoint does not report it ({error_message(exc)[:120]})"
        else:
            why = f"{code_ or 'error'}: {error_message(exc)[:120]}"
    except (BotoCoreError, NotImplementedError) as exc:
        why = f"the Service Quotas API is not available on this endpoint ({type(exc).__name__})"
    return Quota(code, name, None, why)


def instance_vcpus(ec2, types: list[str]) -> dict[str, int]:
    """Default vCPUs per instance type (DescribeInstanceTypes); {} when the call fails."""
    from petctl.io.aws import BotoCoreError, ClientError

    try:
        found = ec2.describe_instance_types(InstanceTypes=sorted(set(types)))["InstanceTypes"]
    except (BotoCoreError, ClientError):
        return {}
    return {t["InstanceType"]: int(t["VCpuInfo"]["DefaultVCpus"]) for t in found}


def check(session, types: list[str], market: str, size: int) -> Verdict:
    """Read the quotas the job's types draw on and assess them."""
    servicequotas = session.client("service-quotas", profile="probe")  # unreadable is a warning, not a wait
    codes = {quota_for(t, market) for t in types} - {None}
    quotas = {code: fetch_quota(servicequotas, code, name) for code, name in codes}
    return assess(types, instance_vcpus(session.client("ec2"), types), quotas, market, size)


# Status messages of failed launches that mean "this AZ has no capacity for this request now"
# (EC2 error codes as the Auto Scaling activity reports them).
CAPACITY_ERRORS = ("InsufficientInstanceCapacity", "InsufficientCapacity", "UnfulfillableCapacity",
                   "capacity-not-available", "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow",
                   "There is no Spot capacity available")
FAILED_STATUSES = frozenset({"Failed", "Cancelled"})

MULTI_AZ_WARNING = ("--multi-az spreads one job over several availability zones: every all-reduce then "
                    "crosses AZs at $0.01/GB each way (tens of USD per hour for a mid-sized model, often "
                    "more than the spot instances cost); use it only when one AZ cannot supply the job")


@dataclass(frozen=True)
class AzChoice:
    """One candidate AZ with its base-stack subnet and how many of the requested types it offers."""

    az: str
    subnet_id: str
    offered: int  # requested instance types offered in this AZ (mixed groups need not have all)


@dataclass
class Placement:
    """The job's AZ plan, kept in S3 (`placement.json`) so a fallback knows what was tried already.

    `azs`/`subnets` are the ranked candidates; `current` indexes the one the group uses now.
    `multi_az`: the group spans every subnet and never falls back."""

    azs: list[str]
    subnets: list[str]
    current: int = 0
    multi_az: bool = False
    moves: list[str] = field(default_factory=list)  # one line per fallback, for `status`/debugging
    moved_at: float = 0.0  # when the group last moved: older activities are about an AZ it left

    @property
    def az(self) -> str:
        return self.azs[self.current]

    @property
    def subnet_ids(self) -> list[str]:
        return list(self.subnets) if self.multi_az else [self.subnets[self.current]]

    @property
    def tried(self) -> list[str]:
        return self.azs[: self.current + 1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> Placement:
        return cls(azs=list(data["azs"]), subnets=list(data["subnets"]), current=int(data.get("current", 0)),
                   multi_az=bool(data.get("multi_az", False)), moves=list(data.get("moves", [])),
                   moved_at=float(data.get("moved_at", 0.0)))


@dataclass(frozen=True)
class Activity:
    """The part of an Auto Scaling scaling activity that decides a fallback."""

    status_code: str  # Successful, Failed, Cancelled, InProgress, ...
    message: str  # StatusMessage (the EC2 error for a failed launch)
    description: str = ""
    az: str = ""  # the activity's AZ when AWS says (its Details JSON), else ""
    start: float = 0.0  # StartTime, epoch seconds (0: unknown)


def rank_azs(offerings: dict[str, set[str]], subnets: dict[str, str], instance_types: list[str],
             tried: set[str] | frozenset[str] = frozenset()) -> list[AzChoice]:
    """AZs to try, best first: those offering every requested type, then those offering most of them;
    ties by name (stable across calls). AZs without a base-stack subnet, offering none of the types or
    already tried are left out.

    `offerings`: AZ -> instance types offered there (DescribeInstanceTypeOfferings, availability-zone).
    `subnets`: AZ -> the base stack's subnet in it. Raises ProviderError when no AZ is left, naming why."""
    wanted = set(instance_types)
    choices = []
    for az, subnet in subnets.items():
        count = len(wanted & offerings.get(az, set()))
        if count and az not in tried:
            choices.append(AzChoice(az=az, subnet_id=subnet, offered=count))
    if not choices:
        where = ", ".join(sorted(subnets)) or "none"
        why = "all were tried" if set(subnets) <= set(tried) else "none offers them"
        raise ProviderError(f"no availability zone of this setup ({where}) can host "
                            f"{', '.join(instance_types)}: {why}; pick other --instance-type values or "
                            "rerun `petctl setup` with more AZs (--option max_azs=...)")
    return sorted(choices, key=lambda c: (-c.offered, c.az))


def plan_placement(offerings: dict[str, set[str]], subnets: dict[str, str], instance_types: list[str],
                   multi_az: bool = False) -> Placement:
    """The initial plan: every usable AZ ranked; the group starts in the first (or spans all)."""
    ranked = rank_azs(offerings, subnets, instance_types)
    return Placement(azs=[c.az for c in ranked], subnets=[c.subnet_id for c in ranked], multi_az=multi_az)


def capacity_failure(activities: list[Activity], az: str = "", since: float = 0.0) -> Activity | None:
    """The newest activity (activities come newest first, as AWS lists them) if it is a launch that failed
    for lack of capacity; None when the newest activity succeeded or failed for another reason (a bad AMI
    or a permission error is not fixed by another AZ). Activities from before `since` or in another AZ
    than `az` (when both are known) are about an AZ the group has left, and are skipped."""
    for activity in activities:
        stale = bool(since and activity.start and activity.start < since)
        if stale or (az and activity.az and activity.az != az):
            continue
        if activity.status_code in ("InProgress", "PreInService", "WaitingForSpotInstanceId",
                                    "WaitingForInstanceId", "PendingSpotBidPlacement"):
            continue  # not decided yet
        if activity.status_code in FAILED_STATUSES and any(
                e.lower() in activity.message.lower() for e in CAPACITY_ERRORS):
            return activity
        return None
    return None


@dataclass(frozen=True)
class Fallback:
    """What to do about the job's AZ: move (to `az`/`subnet_id`) or stay, and why."""

    move: bool
    reason: str
    az: str = ""
    subnet_id: str = ""


def decide_fallback(placement: Placement, activities: list[Activity], in_service: int,
                    desired: int) -> Fallback:
    """Move to the next ranked AZ when the group is short of its desired size and its newest launch
    failed for lack of capacity. Multi-AZ groups never move (Auto Scaling already tries every AZ); the
    last candidate stays (the group keeps retrying there) and says so."""
    if placement.multi_az:
        return Fallback(False, "the group spans every AZ")
    if in_service >= desired:
        return Fallback(False, "the group has its desired capacity")
    failure = capacity_failure(activities, placement.az, placement.moved_at)
    if failure is None:
        return Fallback(False, "no capacity failure in the newest scaling activity")
    if placement.current + 1 >= len(placement.azs):
        return Fallback(False, f"no AZ left to fall back to after {', '.join(placement.tried)} "
                               f"({failure.message.strip()[:120]})")
    nxt = placement.current + 1
    return Fallback(True, f"{placement.az}: {failure.message.strip()[:160]}", az=placement.azs[nxt],
                    subnet_id=placement.subnets[nxt])


def capacity_rebalance(spot: bool, instance_types: list[str], multi_az: bool) -> bool:
    """Whether the job's group turns on Capacity Rebalancing. AWS's setup guide for it starts from several
    instance types and several AZs: the replacement it launches for an at-risk instance comes from another
    spot pool. A group of one type in one AZ has one pool, so rebalancing there only adds an instance from
    the same at-risk pool (billed while idle at --max, and two re-forms per recommendation). The agent's
    checkpoint on a rebalance recommendation (petctl/agent/notices.py) does not depend on this."""
    return spot and (len(set(instance_types)) >= 2 or multi_az)


# AZRebalance terminates instances to even out AZs: in a training group that is a lost node for nothing
# (and in a single-AZ group it has nothing to do). CloudFormation's AutoScalingGroup has no property for
# suspended processes (only rolling-update policies suspend them, during updates), so petctl suspends it
# with the API right after creating the group.
SUSPENDED_PROCESSES = ("AZRebalance",)


def offerings(ec2: Any, instance_types: list[str]) -> dict[str, set[str]]:
    """AZ -> the requested instance types offered there (DescribeInstanceTypeOfferings by AZ)."""
    out: dict[str, set[str]] = {}
    with aws_errors("list instance type offerings by availability zone"):
        pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": list(instance_types)}])
        for page in pages:
            for offer in page.get("InstanceTypeOfferings", []):
                out.setdefault(offer["Location"], set()).add(offer["InstanceType"])
    return out


def activities(autoscaling: Any, group: str, limit: int = 20) -> list[Activity]:
    """The group's newest scaling activities, newest first."""
    with aws_errors(f"describe the scaling activities of {group}"):
        raw = autoscaling.describe_scaling_activities(AutoScalingGroupName=group,
                                                      MaxRecords=limit).get("Activities", [])
    return [Activity(status_code=a.get("StatusCode", ""), message=a.get("StatusMessage", ""),
                     description=a.get("Description", ""), az=_activity_az(a.get("Details", "")),
                     start=a["StartTime"].timestamp() if a.get("StartTime") else 0.0) for a in raw]


def _activity_az(details: str) -> str:
    """The AZ in an activity's Details (JSON, e.g. {"Subnet ID": ..., "Availability Zone": ...})."""
    try:
        value = json.loads(details or "{}")
    except ValueError:
        return ""
    return str(value.get("Availability Zone", "")) if isinstance(value, dict) else ""


def suspend_processes(autoscaling: Any, group: str) -> None:
    with aws_errors(f"suspend {', '.join(SUSPENDED_PROCESSES)} on {group}"):
        autoscaling.suspend_processes(AutoScalingGroupName=group, ScalingProcesses=list(SUSPENDED_PROCESSES))


def move_group(autoscaling: Any, group: str, subnet_ids: list[str]) -> None:
    """Point the group at other subnets; Auto Scaling launches its next instances there."""
    with aws_errors(f"move {group} to subnet(s) {', '.join(subnet_ids)}"):
        autoscaling.update_auto_scaling_group(AutoScalingGroupName=group,
                                              VPCZoneIdentifier=",".join(subnet_ids))


def plan(session: AwsSession, outputs: dict[str, Any], spec: JobSpec,
         progress: Callable[[str], None]) -> Placement:
    """Rank the base stack's AZs by where the job's instance types are offered (no AWS change).

    Raises NotSetUp when the base stack's outputs do not name each subnet's AZ."""
    azs, subnet_ids = outputs.get("AvailabilityZones", "").split(","), outputs["SubnetIds"].split(",")
    if len(azs) != len(subnet_ids):
        raise NotSetUp("the base stack's outputs do not name each subnet's AZ: rerun `petctl setup`")
    subnets = dict(zip(azs, subnet_ids, strict=True))
    offered = offerings(session.client("ec2"), spec.instance_types)
    placement = plan_placement(offered, subnets, spec.instance_types, multi_az=spec.multi_az)
    if spec.multi_az:
        progress(f"WARNING: {MULTI_AZ_WARNING}")
    else:
        progress(f"job {spec.name} placed in {placement.az} (fallback order: "
                 f"{', '.join(placement.azs[1:]) or 'none'})")
    return placement


def poller(check: Callable[[int], Any], name: str, progress: Callable[[str], None]) -> Callable[[int], None]:
    """`check(in_service)` for each poll of run_job's wait. Its failures (throttling, a lost connection)
    must not end run_job, whose job exists by now: they are counted, reported when they start and when
    they end, and the check runs again at the next poll."""
    failures = 0

    def poll(in_service: int) -> None:
        nonlocal failures
        try:
            check(in_service)
        except ProviderError as exc:
            failures += 1
            if failures == 1:
                progress(f"the AZ fallback check of job {name} failed ({exc}); retrying at each poll")
            return
        if failures:
            progress(f"the AZ fallback check of job {name} works again after {failures} failure(s)")
            failures = 0

    return poll


def fall_back(session: AwsSession, store: JobStore, group_name: str, name: str, in_service: int | None,
              progress: Callable[[str], None]) -> str | None:
    """Move the job's group to its next AZ if its newest launch failed for lack of capacity there.

    Returns the new AZ, or None when it stays. The move is recorded in `placement.json` (so the next
    fallback skips the AZs already tried) before the group is changed. The job stack's template keeps
    naming the first subnet: the group drifts from it on purpose (job stacks are never updated)."""
    record = store.get_json("placement.json")
    if not isinstance(record, dict):
        return None  # a job created before placement was recorded: leave it where it is
    placement = Placement.from_dict(record)
    autoscaling = session.client("autoscaling")
    g = inventory.group(autoscaling, group_name, name)
    if in_service is None:
        in_service = len(launched(g))  # capacity EC2 delivered (a booting instance holds its slot)
    decision = decide_fallback(placement, activities(autoscaling, group_name), in_service,
                               int(g["DesiredCapacity"]))
    if not decision.move:
        return None
    placement.current += 1
    placement.moved_at = time.time()
    placement.moves.append(f"{placement.moved_at:.0f} {decision.reason} -> {decision.az}")
    store.put_json("placement.json", json.loads(placement.to_json()))
    move_group(autoscaling, group_name, placement.subnet_ids)
    progress(f"no capacity in {decision.reason}; moved job {name} to {decision.az}")
    return decision.az
