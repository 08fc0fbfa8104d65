"""Where a job's group runs, as I/O around placement.py's decisions: rank the AZs at run_job, and move
the group to the next AZ when its launches fail for lack of capacity (AWS calls in capacity.py).

Kept apart from the provider, which only wires these to its session, job store and progress output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from petctl.core.errors import NotSetUp, ProviderError
from petctl.core.spec import JobSpec
from petctl.io.aws import AwsSession
from petctl.providers.aws import capacity, inventory
from petctl.providers.aws.boots import launched
from petctl.providers.aws.placement import MULTI_AZ_WARNING, Placement, decide_fallback, plan_placement
from petctl.providers.aws.storage import JobStore


def plan(session: AwsSession, outputs: dict[str, Any], spec: JobSpec,
         progress: Callable[[str], None]) -> Placement:
    """Rank the base stack's AZs by where the job's instance types are offered (no AWS change).

    Raises NotSetUp when the base stack's outputs do not name each subnet's AZ."""
    azs, subnet_ids = outputs.get("AvailabilityZones", "").split(","), outputs["SubnetIds"].split(",")
    if len(azs) != len(subnet_ids):
        raise NotSetUp("the base stack's outputs do not name each subnet's AZ: rerun `petctl setup`")
    subnets = dict(zip(azs, subnet_ids, strict=True))
    offered = capacity.offerings(session.client("ec2"), spec.instance_types)
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
    decision = decide_fallback(placement, capacity.activities(autoscaling, group_name), in_service,
                               int(g["DesiredCapacity"]))
    if not decision.move:
        return None
    placement.current += 1
    placement.moved_at = time.time()
    placement.moves.append(f"{placement.moved_at:.0f} {decision.reason} -> {decision.az}")
    store.put_json("placement.json", json.loads(placement.to_json()))
    capacity.move_group(autoscaling, group_name, placement.subnet_ids)
    progress(f"no capacity in {decision.reason}; moved job {name} to {decision.az}")
    return decision.az
