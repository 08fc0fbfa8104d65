"""`petctl status`: a job's state and its nodes, as the provider and the agents see it."""

from __future__ import annotations

import time
from typing import Any

import click

from petctl.cli.bootview import boot_section, echo_boots
from petctl.cli.context import job_view, provider_for
from petctl.cli.render import output_option, print_json, status_summary, table

FINAL_STATES = ("succeeded", "failed", "killed")


def job_status(info, state) -> dict[str, Any]:
    """What `status -o json` prints: the provider's view of the job (`JobInfo`) plus the agents'
    (`JobState`, from etcd or the job's mirror)."""
    data = state.to_dict()
    final = info.state in FINAL_STATES
    current = state.round
    data.update(
        state=info.state if final else state.state,
        reason=(state.result.reason if state.result else "") or info.reason,
        desired=info.desired, min_size=info.min_size, max_size=info.max_size,
        ranks=state.ranks,
        round_no=current.round if current else None,
        # Worker failures so far in the job (the round's count, bounded by --max-restarts): not re-forms,
        # which the accounting counts. `restarts` is the same number under its old name.
        failure_restarts=current.restarts if current else None,
        restarts=current.restarts if current else None,
    )
    return data


def checkpoint_step(value: Any) -> Any:
    """The agent publishes {"step", "url", "interval_s"}; the table shows the step (and, under
    every="auto", the durable interval chosen: its reason is in `petctl events`' checkpoint.interval)."""
    if not isinstance(value, dict):
        return value
    every = value.get("interval_s")
    return value.get("step") if every is None else f"{value.get('step')} (auto every {every:g}s)"


STALE_AFTER = 30.0  # a node's step older than this is shown with its age


def aged(value: Any, updated: Any, now: float) -> Any:
    """`value` (a node's step or checkpoint) with how old its publication is, when that is over
    STALE_AFTER seconds: at rest an agent puts its progress every few minutes only (agent/reporting.py),
    so "1200 (4m ago)" says what the number is. Unchanged when there is no value or no publication time."""
    if value is None or not isinstance(updated, int | float) or updated <= 0:
        return value
    age = now - updated
    if age <= STALE_AFTER:
        return value
    return f"{value} ({int(age // 60)}m ago)" if age >= 60 else f"{value} ({int(age)}s ago)"


def failures_text(failures: dict[str, int] | None) -> str:
    """A node's counted failures, service=count (empty when none)."""
    return ", ".join(f"{service}={count}" for service, count in sorted((failures or {}).items()) if count)


def echo_activities(lines: list[str]) -> None:
    """The capacity's recent scaling activities (why instances launch or not), newest first."""
    if lines:
        click.echo("scaling activities (newest first):")
        for line in lines:
            click.echo(f"  {line}")


def worker_failure(view, state: str) -> dict[str, Any] | None:
    """For a failed job, the failing worker's last error lines (`petctl.jobview.failure`); None for any
    other job, or when the timeline cannot be read (the summary already says why)."""
    from petctl.core.errors import PetctlError
    from petctl.jobview.failure import last_failure

    if state != "failed":
        return None
    try:
        failure = last_failure(view.events())
    except PetctlError:
        return None
    return failure.to_dict() if failure is not None else None


def echo_failure(failure: dict[str, Any] | None) -> None:
    """The failing worker's error lines, as one indented block."""
    from petctl.jobview.failure import WorkerFailure

    if failure:
        for line in WorkerFailure.from_dict(failure).block():
            click.echo(line)


def node_rows(data: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The node table, rank order; a `failures` column only when some node counted failures."""
    ranks = data["ranks"]
    nodes = sorted(data["nodes"].values(),
                   key=lambda n: (ranks.get(n.get("node_id"), 1 << 30), str(n.get("node_id"))))
    # A script that reports no steps: "n/a" (the one-line summary says why), not a bare "-".
    no_step = None if data["accounting"].get("steps_reported", True) else "n/a"
    columns = ["node", "rank", "world size", "round", "failure restarts", "state", "step", "checkpoint"]
    now = time.time()
    rows = [[n.get("node_id"), n.get("rank"), n.get("world_size"), n.get("round"), n.get("restarts"),
             n.get("state"), aged(n.get("step"), n.get("updated"), now) if n.get("step") is not None
             else no_step, checkpoint_step(n.get("last_checkpoint"))] for n in nodes]
    failures = [failures_text(n.get("failures")) for n in nodes]
    if any(failures):
        columns.append("failures")
        for row, text in zip(rows, failures, strict=True):
            row.append(text)
    return columns, rows


@click.command("status")
@click.argument("name")
@output_option
def status(name: str, output: str) -> None:
    """A job's state and its nodes: rank, world size, round, failure restarts, state, step, and each node's
    counted failures (etcd, mirror, heartbeat, ...) when it has any. For a failed job, the failing
    worker's last error lines; where instances boot (AWS), boot failures and the newest one's boot log
    lines."""
    from petctl.jobview.summary import one_line, summarize
    from petctl.providers.capabilities import CapacityInsight

    provider = provider_for()
    info = provider.job(name)
    view = job_view(name)
    data = job_status(info, view.state())
    data["accounting"] = summarize(view, running=data["state"] not in FINAL_STATES,
                                   live_steps=any(n.get("step") is not None for n in data["nodes"].values()))
    data["scaling_activities"] = (provider.scaling_activities(name) if isinstance(provider, CapacityInsight)
                                  else [])
    data["corrupt_records"] = view.corrupt.to_dict()
    data["last_error"] = worker_failure(view, data["state"])
    data["notes"] = view.notes()
    data["boots"] = boot_section(provider, name, data["notes"])
    if output == "json":
        print_json(data)
        return
    click.echo(status_summary(data))
    click.echo(one_line(data["accounting"]))
    echo_activities(data["scaling_activities"])
    echo_failure(data["last_error"])
    echo_boots(data["boots"], data["state"])
    for note in data["notes"]:
        click.echo(f"note: {note}")
    if data["source"] == "mirror":
        click.echo("(from the agents' mirror in the job's prefix: etcd does not answer from here)")
    if not data["nodes"]:
        click.echo("no live nodes" if data["state"] not in FINAL_STATES
                   else "the job is over; its node logs: `petctl logs " + name + "`")
        return
    columns, rows = node_rows(data)
    table(None, columns, rows)


COMMANDS = (status,)
