"""The boot breaker: a job whose instances keep failing to boot stops launching them.

Without it an Auto Scaling group replaces a failed instance forever: an arm64 image, a missing secret or a
bad requirement cycles GPU instances until someone runs `kill_job`. Each boot leaves `BootRecord`s in the
job's prefix (`boots/<ts>.<instance id>.<event>.json`: started, installing, joined, failed), and the
decision is this pure function over them, taken from one listing of the keys:

- a boot's outcome is `joined` at the time its agent registered in the rendezvous, or `never joined`:
  at the time its boot script failed, or, for a boot that wrote neither, once it is `boot_timeout` old
  (the launch lifecycle hook abandons such an instance then: DefaultResult ABANDON);
- outcomes are ordered by their time (a join after failures resets the count, failures after a join
  count again), and a boot still inside its timeout has no outcome yet (it neither counts nor resets);
- the breaker trips when the newest `limit` outcomes all are `never joined`.

The same rule runs in bash on the instance (`boots_never_joined` in worker_image/boot_record.sh.j2, by
the boot that fails and by each boot as it starts, so nothing depends on a CLI being open);
tests/aws/test_boot_breaker.py runs one table through both. The CLI uses it to explain (`status`,
`run_job --wait`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from petctl.core.records import BootRecord

BOOT_EVENTS = ("started", "installing", "joined", "failed")
# Three boots that never joined end the job. One failure can be bad luck (a spot instance reclaimed while
# it installed, a package index hiccup the boot's retries did not outlast); three in a row, with nothing
# joining in between, is a job that cannot boot, and each retry bills a GPU for up to `boot_timeout`.
BREAKER_LIMIT = 3
BOOTS_DIR = "boots"
_KEY_RE = re.compile(r"(?:^|/)(\d{10})\.(i-[0-9A-Za-z]+)\.(started|installing|joined|failed)\.json$")


def boot_key(record: BootRecord) -> str:
    """Where `record` goes under the job's prefix: `boots/<ts, 10 digits>.<instance>.<event>.json`, so a
    listing (which S3 returns in key order) is in time order and says everything the breaker needs."""
    return f"{BOOTS_DIR}/{int(record.ts):010d}.{record.instance_id}.{record.event}.json"


@dataclass(frozen=True)
class BootMark:
    """What a boot record's key says: when, which instance, which event."""

    ts: int
    instance_id: str
    event: str


def parse_boot_key(key: str) -> BootMark | None:
    """The mark a key names (a full key or one relative to the prefix); None for anything else."""
    match = _KEY_RE.search(key)
    return BootMark(int(match.group(1)), match.group(2), match.group(3)) if match else None


@dataclass(frozen=True)
class BreakerVerdict:
    """The breaker's view: `never_joined` boots in a row (newest last), whether that trips it, and the
    newest of them (`last_instance`, `last_hung`: it wrote no failure, its hook timed out)."""

    never_joined: int
    tripped: bool
    limit: int
    last_instance: str = ""
    last_hung: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"never_joined": self.never_joined, "tripped": self.tripped, "limit": self.limit,
                "last_instance": self.last_instance, "last_hung": self.last_hung}


def outcomes(marks: Iterable[BootMark], now: float, boot_timeout: float) -> list[tuple[float, str, str]]:
    """Each boot's outcome as (time, "failed" | "hung" | "joined", instance), in time order. A boot
    without one yet (inside its timeout) is left out."""
    started: dict[str, int] = {}
    joined: dict[str, int] = {}
    failed: dict[str, int] = {}
    for mark in marks:
        table = {"started": started, "joined": joined, "failed": failed}.get(mark.event)
        if table is not None:
            table[mark.instance_id] = max(mark.ts, table.get(mark.instance_id, mark.ts))
    out: list[tuple[float, str, str]] = []
    for instance in set(started) | set(joined) | set(failed):
        if instance in joined:
            out.append((joined[instance], "joined", instance))
        elif instance in failed:
            out.append((failed[instance], "failed", instance))
        elif now - started[instance] >= boot_timeout:
            out.append((started[instance] + boot_timeout, "hung", instance))
    # "failed" < "hung" < "joined": at equal times a join is taken as the later one (the shell sorts the
    # same way: `LC_ALL=C sort -k1,1n -k2,2 -k3,3`)
    return sorted(out)


def breaker(marks: Iterable[BootMark], now: float, boot_timeout: float,
            limit: int = BREAKER_LIMIT) -> BreakerVerdict:
    """How many boots in a row never joined, and whether that trips the breaker (see the module doc)."""
    count, last = 0, None
    for outcome in outcomes(marks, now, boot_timeout):
        if outcome[1] == "joined":
            count, last = 0, None
        else:
            count, last = count + 1, outcome
    return BreakerVerdict(never_joined=count, tripped=count >= limit, limit=limit,
                          last_instance=last[2] if last else "", last_hung=bool(last) and last[1] == "hung")


def trip_reason(count: int, error: str) -> str:
    """The failed job's reason: what `status` shows (the boot script writes the same words)."""
    return f"{count} boots in a row never joined: {error}"


def hung_error(instance_id: str, boot_timeout: float) -> str:
    """What a boot that neither joined nor failed is reported as."""
    return f"{instance_id} did not join within {boot_timeout:.0f}s (its launch hook abandoned it)"


@dataclass
class BootReport:
    """Each instance's boot stage (`launching` when the group has it but it wrote nothing yet, else its
    newest event), the breaker's verdict, and the newest failure's record (error and log lines)."""

    stages: dict[str, str]
    verdict: BreakerVerdict
    last_failure: BootRecord | None = None
    joined: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"stages": dict(self.stages), "breaker": self.verdict.to_dict(), "joined": list(self.joined),
                "last_failure": self.last_failure.to_dict() if self.last_failure else None}


def stages(marks: Iterable[BootMark], launching: Iterable[str] = ()) -> dict[str, str]:
    """instance -> its newest boot event (`joined` and `failed` outrank later stage marks); instances in
    `launching` (the group's) that wrote nothing yet are `launching`."""
    rank = {event: i for i, event in enumerate(BOOT_EVENTS)}
    out: dict[str, str] = dict.fromkeys(launching, "launching")
    for mark in sorted(marks, key=lambda m: (m.ts, rank[m.event])):
        if out.get(mark.instance_id) not in ("joined", "failed") or mark.event == "joined":
            out[mark.instance_id] = mark.event
    return out
