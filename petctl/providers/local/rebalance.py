"""The local provider's Capacity Rebalancing: what an EC2 Auto Scaling group with `CapacityRebalance` does
when one of its spot instances gets a rebalance recommendation.

AWS launches a replacement first and, once the replacement is in service, terminates the at-risk instance
through the normal scale-in path: the termination lifecycle hook, which the instance sees as
`autoscaling/target-lifecycle-state` = `Terminated` (an "asg" notice). We do the same, one tick at a time:

    `petctl chaos --rebalance`   notices/<iid>.json = {"kind": "rebalance", "time": issued, "grace": g}
    launch a replacement         ... + "replacement": <new iid>   (the group is one over desired)
    the replacement in service   {"kind": "asg", "time": now + g, "rebalance": issued, "replacement": ...}
    the reclaim                  the reconciler SIGKILLs the at-risk instance at `time`, as for any notice

"In service" here: the replacement holds a rank in the current round (the job grew onto it), so the job
grows and then shrinks, one change at a time. When the round is already at the job's max it cannot take
the replacement while the at-risk node holds its place: then the replacement's agent being up (its
heartbeat in etcd) is enough, and it takes the freed place after the at-risk node leaves.

Over the maximum: while it replaces instances, an ASG may exceed its MaxSize (the job's max) by 10% of
the desired capacity or by one instance, whichever is greater. We allow the same margin; beyond it the
replacement waits for room, as AWS's would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from petctl.io.eventlog import EventLog
from petctl.providers.local.instances import Instance
from petctl.providers.local.jobdir import JobDir

DEFAULT_GRACE = 10.0  # the scale-in notice's time to the reclaim, when the recommendation names none
OVER_MAX_SHARE = 0.1


def over_max_allowance(desired: int) -> int:
    """How far over its max an ASG may go while it replaces instances: 10% of desired, at least one."""
    return max(1, int(desired * OVER_MAX_SHARE))


def in_service(iid: str, ranks: dict[str, int], alive: set[str], max_size: int) -> bool:
    """The replacement holds a rank in the current round; or, the round being full, its agent is up."""
    return iid in ranks or (len(ranks) >= max_size and iid in alive)


@dataclass
class Plan:
    launch: list[str] = field(default_factory=list)  # at-risk instances that need a replacement launched
    retire: list[str] = field(default_factory=list)  # at-risk instances whose replacement is in service


def with_replaced(victims: list[str], replaced_by: dict[str, str]) -> list[str]:
    """Scale-in victims, each rebalance replacement among them with the at-risk instance it replaces.

    The at-risk instance no longer counts toward desired (its replacement does), so a scale-in that picks
    the replacement alone leaves the at-risk one waiting for a replacement: the rebalancer launches
    another, the next scale-in takes it, and so on every tick (the soak saw 240 launches in a minute).
    Both go: the at-risk instance was leaving anyway, and the group lands on its desired size."""
    out = list(victims)
    out += [at_risk for at_risk, replacement in sorted(replaced_by.items()) if replacement in victims]
    return out


def plan(at_risk: dict[str, dict[str, Any]], live: set[str], ranks: dict[str, int], alive: set[str],
         max_size: int, desired: int) -> Plan:
    """What to do this tick about the instances with a rebalance recommendation (`at_risk`: their
    notices, oldest first). A replacement that died (or was never launched) is launched again, room
    permitting; one in service retires the instance it replaces."""
    out = Plan()
    count, cap = len(live), max_size + over_max_allowance(desired)
    for iid, notice in sorted(at_risk.items(), key=lambda kv: float(kv[1]["time"])):
        replacement = notice.get("replacement")
        if replacement in live:
            if in_service(str(replacement), ranks, alive, max_size):
                out.retire.append(iid)
        elif count < cap:
            out.launch.append(iid)
            count += 1
    return out


class CapacityRebalancer:
    """The reconciler's rebalancing step; `launch(at_risk)` launches the replacement of `at_risk` (the
    reconciler's, so it gets its metadata endpoint and boots as every replacement does),
    `ranks()`/`alive()` read the job's round and heartbeats from etcd."""

    def __init__(self, job: JobDir, events: EventLog, max_size: int, launch: Callable[[str], Instance | None],
                 ranks: Callable[[], dict[str, int]], alive: Callable[[], set[str]]) -> None:
        self.job = job
        self.events = events
        self.max_size = max_size
        self.launch = launch
        self.ranks = ranks
        self.alive = alive

    def leaving(self, live: list[Instance]) -> set[str]:
        """Instances a replacement was launched for: the group's size counts the replacement instead."""
        return {i.id for i in live if "replacement" in (self.job.read_notice(i.id) or {})}

    def replaced_by(self, live: list[Instance]) -> dict[str, str]:
        """At-risk instance -> the replacement launched for it, for those that have one."""
        out = {}
        for i in live:
            replacement = (self.job.read_notice(i.id) or {}).get("replacement")
            if replacement:
                out[i.id] = str(replacement)
        return out

    def tick(self, live: list[Instance], desired: int, now: float) -> None:
        notices = {i.id: n for i in live if (n := self.job.read_notice(i.id)) is not None}
        at_risk = {iid: n for iid, n in notices.items() if n.get("kind") == "rebalance"}
        if not at_risk:
            return
        live_ids = {i.id for i in live}
        waiting = any(n.get("replacement") in live_ids for n in at_risk.values())
        ranks = self.ranks() if waiting else {}
        alive = self.alive() if waiting and len(ranks) >= self.max_size else set()
        todo = plan(at_risk, live_ids, ranks, alive, self.max_size, desired)
        for iid in todo.launch:
            self._replace(iid, at_risk[iid])
        for iid in todo.retire:
            self._retire(iid, at_risk[iid], now)

    def _replace(self, iid: str, notice: dict[str, Any]) -> None:
        replacement = self.launch(iid)
        if replacement is None:  # the job ended meanwhile
            return
        # A relaunch (the earlier replacement died) names the new one in place of the old: one key each.
        self.job.write_notice(iid, "rebalance", float(notice["time"]),
                              **{**_carry(notice), "replacement": replacement.id})
        self.events.emit("rebalance.replacing", instance=iid, replacement=replacement.id)

    def _retire(self, iid: str, notice: dict[str, Any], now: float) -> None:
        """The scale-in through the termination lifecycle hook: the instance sees `Terminated`."""
        grace = float(notice.get("grace", DEFAULT_GRACE))
        self.job.write_notice(iid, "asg", now + grace, **_carry(notice), rebalance=float(notice["time"]))
        self.events.emit("rebalance.scale_in", instance=iid, replacement=notice.get("replacement"),
                         reclaim_at=round(now + grace, 3))


def _carry(notice: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in notice.items() if k not in ("kind", "time")}
