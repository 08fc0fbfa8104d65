"""Boots as the CLI shows them: `run_job --wait`'s progress on a provider whose instances boot (AWS), and
the boot section of `status` (the breaker's count, the newest failure and its boot log lines)."""

from __future__ import annotations

import time
from typing import Any

import click

from petctl.core.errors import PetctlError

STAGE_WORDS = {"launching": "launching", "started": "booting", "installing": "installing",
               "joined": "joined the rendezvous", "failed": "boot failed"}


def stage_line(instance: str, stage: str, report) -> str:
    """One progress line; a failure says why when it is the newest one, and how close the breaker is."""
    line = f"  {instance}: {STAGE_WORDS.get(stage, stage)}"
    if stage == "failed":
        last = report.last_failure
        if last is not None and last.instance_id == instance and last.error:
            line += f": {last.error}"
        v = report.verdict
        line += f" ({v.never_joined} boot(s) in a row never joined; the job stops at {v.limit})"
    return line


def wait_joined(provider, name: str, timeout: float, interval: float = 1.0) -> str:
    """Block until the job's first agent joined the rendezvous (its boot worked end to end), showing
    each instance's stage as it changes and boot failures as they happen. Returns that instance's id.
    Raises PetctlError when the job ends first (a tripped boot breaker: its reason) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    shown: dict[str, str] = {}
    while True:
        report = provider.boots(name)
        for instance, stage in sorted(report.stages.items()):
            if shown.get(instance) != stage:
                shown[instance] = stage
                click.echo(stage_line(instance, stage, report))
        if report.joined:
            click.echo(f"job {name}: {report.joined[0]} joined; follow it with `petctl status {name}`")
            return report.joined[0]
        info = provider.job(name)
        if info.state not in ("running", "pending"):
            raise PetctlError(f"job {name!r} {info.state} before any agent joined: {info.reason} "
                              f"(see `petctl status {name}`)")
        if time.monotonic() > deadline:
            raise PetctlError(f"no agent of job {name!r} joined within {timeout:.0f}s (see `petctl status "
                              f"{name}`); the job goes on")
        time.sleep(interval)


def boot_section(provider, name: str, notes: list[str]) -> dict[str, Any] | None:
    """`status`'s `boots`: the provider's boot report as a dict, or None where instances do not boot
    (local). A report that cannot be read is a note, not a failed `status`."""
    from petctl.providers.capabilities import BootInsight

    if not isinstance(provider, BootInsight):
        return None
    try:
        return provider.boots(name).to_dict()
    except PetctlError as e:
        notes.append(f"boot records not readable: {e}")
        return None


def echo_boots(boots: dict[str, Any] | None, state: str) -> None:
    """Boot failures, when there are any: the breaker's count and the newest failure's log lines."""
    if not boots:
        return
    breaker, last = boots["breaker"], boots["last_failure"]
    if breaker["never_joined"]:
        click.echo(f"boots: {breaker['never_joined']} in a row never joined (the job stops at "
                   f"{breaker['limit']})")
    if last and (breaker["never_joined"] or state == "failed"):
        click.echo(f"newest boot failure, on {last['instance_id']}: {last['error']}")
        for line in last["log_tail"]:
            click.echo(f"  | {line}")
