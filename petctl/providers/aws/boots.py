"""How a job's instances boot, read from its prefix and its group: for `status` and `run_job --wait`.

The boot script and the agent write `BootRecord`s to `boots/` in the job's prefix (worker_image/
boot_record.sh.j2, petctl/agent/notices.py); the rule that stops a job whose boots never join is
petctl/core/boots.py, applied on the instances themselves. This module only reads: the listing (stages and
the breaker's view), the newest failure's record (its error and boot log lines), and the group's
instances that wrote nothing yet (`launching`).
"""

from __future__ import annotations

import time
from typing import Any

from petctl.core.boots import BREAKER_LIMIT, BootReport, breaker, parse_boot_key, stages
from petctl.core.records import BootRecord, WireFormatError
from petctl.core.spec import AgentConfig, Timeouts
from petctl.providers.aws.storage import JobStore, job_prefix

# An instance the group has while it launches (Pending, held in the launch hook) or runs: capacity EC2
# delivered, whether or not its boot has joined yet.
LAUNCHED_STATES = ("Pending", "Pending:Wait", "Pending:Proceed", "InService")


def boot_settings(config: AgentConfig) -> dict[str, Any]:
    """What the boot script's records and breaker need (worker_image/boot_record.sh.j2)."""
    url = config.status_url
    bucket, _, prefix = url[len("s3://"):].partition("/") if url.startswith("s3://") else ("", "", "")
    return {"bucket": bucket, "prefix": prefix.rstrip("/") or job_prefix(config.job.name),
            "job": config.job.name, "asg": config.asg_name, "launch_hook": config.launch_hook,
            "timeout": int(config.job.timeouts.boot_timeout), "limit": BREAKER_LIMIT}


def launched(group: dict[str, Any]) -> list[str]:
    """The group's instances that EC2 launched (see LAUNCHED_STATES)."""
    return [i["InstanceId"] for i in group.get("Instances", []) if i.get("LifecycleState") in LAUNCHED_STATES]


def boot_timeout(store: JobStore) -> float:
    """The job's `Timeouts.boot_timeout` (job.json), or the default for a job that does not say."""
    spec = store.get_json("job.json")
    timeouts = spec.get("timeouts") if isinstance(spec, dict) else None
    return Timeouts.from_dict(timeouts if isinstance(timeouts, dict) else {}).boot_timeout


def report(store: JobStore, group: dict[str, Any] | None, now: float | None = None) -> BootReport:
    """The job's boots as of `now`. Raises ProviderError when the prefix cannot be read."""
    marks = [m for key in store.list_keys("boots") if (m := parse_boot_key(key)) is not None]
    verdict = breaker(marks, time.time() if now is None else now, boot_timeout(store))
    failures = sorted((m for m in marks if m.event == "failed"), key=lambda m: (m.ts, m.instance_id))
    last = None
    if failures:
        newest = failures[-1]
        data = store.get_bytes(f"boots/{newest.ts:010d}.{newest.instance_id}.failed.json")
        try:
            last = BootRecord.from_json(data.decode("utf-8", "replace")) if data else None
        except WireFormatError:  # a record cut short: the listing still says it failed
            last = BootRecord(instance_id=newest.instance_id, event="failed", ts=newest.ts,
                              error="(its boot record is not readable)")
    joined = sorted({m.instance_id for m in marks if m.event == "joined"})
    return BootReport(stages(marks, launched(group) if group else ()), verdict, last, joined)
