"""Taking an instance away on purpose: what a lost, hung, drained or reclaimed machine looks like.

    kill      SIGKILL the whole process group   (the host vanished; sockets close)
    freeze    SIGSTOP the whole process group   (the host hangs; sockets stay open, heartbeats stop)
    unfreeze  SIGCONT the whole process group   (the hung host comes back)
    term      SIGTERM the agent                 (a clean scale-in: the agent leaves gracefully)
    notice    a spot notice at now, reclaimed (SIGKILL) at now + grace by the reconciler
    rebalance a rebalance recommendation at now; the reconciler launches a replacement, and once it is in
              service gives this one an ASG scale-in notice, reclaimed at grace later (see rebalance.py)

The mode is written next to the instance first, so the reconciler can say why the instance went.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from petctl.core.errors import PetctlError, ValidationError
from petctl.io.procs import ProcRef
from petctl.providers.base import HostInfo
from petctl.providers.local.jobdir import JobDir

MODES = ("kill", "freeze", "unfreeze", "term", "notice", "rebalance")
NOTICES = ("notice", "rebalance")  # modes that leave a notice (one per instance)


def host_info(row: dict[str, Any]) -> HostInfo:
    """instances.json row -> HostInfo, with the live state checked against the process itself. A booting
    instance (launched, its agent not started yet) is `pending`, as EC2 says; a detached one that still
    runs is `detached` (it no longer counts toward the job's size)."""
    state = row.get("state", "terminated")
    if state == "booting":
        state = "pending"
    elif state in ("running", "frozen", "terminating"):
        ref = ProcRef(int(row["pid"]), row.get("start"))
        if not ref.alive():
            state = "terminated"
        elif state != "terminating":
            state = "frozen" if ref.frozen() else "detached" if row.get("detached_at") else "running"
    return HostInfo(host_id=row["id"], state=state, instance_type="local", market="local",
                    private_ip="127.0.0.1", launched_at=row.get("launched_at"))


def pick(job: JobDir, ranks: dict[str, int], host_id: str | None, mode: str) -> HostInfo:
    """The instance `take_away` acts on (see `choose_target`), read from the job's directory."""
    hosts = [host_info(row) for row in job.read_instances()]
    noticed = {h.host_id: n for h in hosts if (n := job.read_notice(h.host_id)) is not None}
    return choose_target(job.name, hosts, ranks, noticed, host_id, mode)


def choose_target(job: str, hosts: list[HostInfo], ranks: dict[str, int], noticed: dict[str, dict[str, Any]],
                  host_id: str | None, mode: str) -> HostInfo:
    """The named instance, or by default the highest-ranked live one in the current round.

    An instance with a pending notice is already leaving: the default never picks it (a second notice
    would take no capacity away and would move its reclaim time), and a notice to it by name is an error.
    Instances outside the round (a replacement still warming up, a node that left) are the default only
    when no round has formed at all. `unfreeze` picks among frozen instances.

    Raises PetctlError when the named instance does not exist or cannot take `mode`, or when no instance
    can.
    """
    wanted = ("frozen",) if mode == "unfreeze" else ("running", "frozen") if mode == "kill" else ("running",)
    if host_id is not None:
        for h in hosts:
            if h.host_id == host_id:
                if h.state not in wanted:
                    raise PetctlError(f"instance {host_id} of job {job!r} is {h.state}: cannot {mode} it")
                if mode in NOTICES and host_id in noticed:
                    raise PetctlError(f"instance {host_id} of job {job!r} already has "
                                      f"{_describe_notice(noticed[host_id])}: it is leaving")
                return h
        raise PetctlError(f"no instance {host_id!r} in job {job!r} (see `petctl hosts {job}`)")
    candidates = [h for h in hosts if h.state in wanted and (mode == "unfreeze" or h.host_id not in noticed)]
    ranked = [h for h in candidates if h.host_id in ranks]
    if ranked:
        return max(ranked, key=lambda h: ranks[h.host_id])
    if candidates and (not ranks or mode == "unfreeze"):  # no round yet, or a frozen host it dropped
        return max(candidates, key=lambda h: h.launched_at or 0)
    raise PetctlError(f"job {job!r} has no {'/'.join(wanted)} instance in its current round to {mode}"
                      + (" (the others have a pending notice)" if noticed else ""))


def _describe_notice(notice: dict[str, Any]) -> str:
    if notice.get("kind") == "rebalance":
        return "a rebalance recommendation"
    when = notice.get("time")
    at = time.strftime("%H:%M:%S", time.localtime(float(when))) if when else "soon"
    return f"a notice (reclaimed at {at})"


def take_away(job: JobDir, ranks: dict[str, int], host_id: str | None, mode: str, grace: float = 0.0) -> str:
    if mode not in MODES:
        raise ValidationError(f"unknown chaos mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode in NOTICES and grace < 0:
        raise ValidationError(f"--grace must be >= 0 (got {grace})")
    host = pick(job, ranks, host_id, mode)
    row = next(r for r in job.read_instances() if r["id"] == host.host_id)
    ref = ProcRef(int(row["pid"]), row.get("start"))
    if mode != "unfreeze":
        job.chaos_marker(host.host_id).write_text(mode + "\n")
    if mode == "kill":
        ref.signal_group(signal.SIGKILL)
    elif mode == "freeze":
        ref.signal_group(signal.SIGSTOP)
    elif mode == "unfreeze":
        ref.signal_group(signal.SIGCONT)
    elif mode == "term":
        ref.signal(signal.SIGTERM)
    elif mode == "rebalance":  # the grace is for the scale-in notice that follows the replacement
        job.write_notice(host.host_id, "rebalance", time.time(), grace=grace)
    else:
        job.write_notice(host.host_id, "spot", time.time() + grace)
    return host.host_id
