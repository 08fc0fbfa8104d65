"""Commands that explain a job after the fact: its event timeline, goodput and a charted report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from petctl.cli.context import job_view, provider_for
from petctl.cli.render import output_option, print_json, table
from petctl.jobview.summary import basis_text

# Events worth a line in `petctl events` by default; --all shows every one (checkpoints included).
HEADLINES = {
    "agent.started", "agent.left", "agent.exit", "rendezvous.complete", "rendezvous.restart",
    "membership.lost", "membership.waiting", "workers.failed", "workers.succeeded", "heartbeat.lost",
    "peer.silent", "heartbeat.gap",
    "preemption.notice", "preemption.announced", "preemption.save_timeout", "checkpoint.saved",
    "checkpoint.loaded", "job.result", "instance.launched", "instance.terminated", "instance.reclaimed",
    "scale.changed", "release.done", "release.partial",
    "capacity.detached", "capacity.detach_failed", "capacity.ending", "capacity.end_failed",
}
DETAIL_FIELDS = ("round", "rank", "world_size", "cause", "nodes", "step", "kind", "state", "reason", "code",
                 "seconds", "why", "desired")


def echo_notes(notes: list[str]) -> None:
    """How the timeline was read, when the user should know (on stderr: stdout may be JSON)."""
    for note in notes:
        click.echo(f"note: {note}", err=True)


def _detail(event: dict) -> str:
    parts = []
    for key in DETAIL_FIELDS:
        value = event.get(key)
        if value not in (None, "", []):
            parts.append(f"{key}={','.join(map(str, value)) if isinstance(value, list) else value}")
    return " ".join(parts)


@click.command("events")
@click.argument("name")
@click.option("--all", "show_all", is_flag=True, help="Every event, not just the headline ones.")
@output_option
def events_cmd(name: str, show_all: bool, output: str) -> None:
    """The job's timeline: rounds, re-forms and why, preemptions, checkpoints, scale changes."""
    provider_for().job(name)  # unknown job -> one-line error
    view = job_view(name)
    events = view.events()
    echo_notes(view.notes())
    if not show_all:
        events = [e for e in events if e.get("event") in HEADLINES]
    if output == "json":
        print_json(events)
        return
    t0 = events[0]["ts"] if events else time.time()
    rows = [(f"+{e['ts'] - t0:8.2f}s", e.get("node") or e.get("instance") or "-", e["event"], _detail(e))
            for e in events]
    table(f"events of {name} (from {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))})",
          ["t", "node", "event", "detail"], rows)


def report_rows(acc) -> list[tuple[str, Any]]:
    """The report's table (an `Accounting`): n/a for what a job without step lines cannot tell."""
    goodput = f"{acc.goodput:.1%}" if acc.goodput is not None else f"n/a ({acc.goodput_note})"
    reforming = (f"≥{acc.reform_seconds:.1f}s (a lower bound: round end to workers restarted; with no "
                 "step events, when training resumed is not seen)" if acc.reform_lower_bound
                 else f"{acc.reform_seconds:.1f}s (disruption to training again)")
    return [
        ("goodput (kept node-time / instance node-time)", goodput),
        ("steps kept / lost", f"{acc.steps_kept} / {'>= ' if acc.steps_lost_lower_bound else ''}"
                              f"{acc.steps_lost}" if acc.steps_reported else "n/a"),
        ("re-forms (membership changes and failure restarts)", acc.reforms),
        ("failure restarts (counted against --max-restarts)", acc.failure_restarts),
        ("preemption notices", acc.preemption_notices),
        ("time re-forming", reforming),
        ("instance time", f"{acc.instance_seconds / 3600:.3f} node-hours over {acc.nodes} nodes"
                          f"{basis_text(acc.billing_basis)}"),
    ]


@click.command("report")
@click.argument("name")
@click.option("--png", "png", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the timeline chart (default ./<job>-timeline.png).")
@output_option
def report_cmd(name: str, png: Path | None, output: str) -> None:
    """Goodput, lost steps, re-forms, failure restarts and a PNG chart of the job's timeline."""
    from petctl.jobview.report import render_timeline

    info = provider_for().job(name)
    view = job_view(name)
    events = view.events()
    echo_notes(view.notes())
    acc = view.accounting(events, running=info.state == "running")
    data = {"job": name, "state": info.state, "reason": info.reason, **acc.to_dict()}
    data.pop("rounds")

    data["chart"] = str(render_timeline(name, events, acc, png or Path(f"{name}-timeline.png")))
    if output == "json":
        print_json({**data, "rounds": [r.__dict__ for r in acc.rounds]})
        return
    table(f"report for {name}: {info.state}", ["measure", "value"],
          [*report_rows(acc), ("chart", data.get("chart", "-"))])


COMMANDS = (events_cmd, report_cmd)
