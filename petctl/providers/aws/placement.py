"""Where a job's instances go: one availability zone per job, and the next one when capacity runs out.

Why one AZ: DDP all-reduces every step, and data between AZs is billed $0.01/GB each way; for a ResNet-50
pair that is roughly $15-45/h against under $1/h of spot compute. Within an AZ the traffic is free. So a
job's group gets one subnet, in an AZ where every requested instance type is offered, and moves to the
next AZ (by updating the group's VPCZoneIdentifier) when its scaling activities show that the chosen AZ
cannot supply the capacity. Spreading a job over AZs stays possible (`run_job --multi-az`), loudly warned.

Everything here is pure: records in, decisions out. The provider does the AWS calls.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from petctl.core.errors import ProviderError

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
