"""Output: rich tables for people, JSON (`-o json`) for scripts. rich is imported only when a table is
drawn, so the CLI starts fast."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import click

output_option = click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
                             show_default=True, help="Output format.")


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return str(value)


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    t = Table(title=title, title_justify="left", header_style="bold")
    for column in columns:
        t.add_column(column)
    for row in rows:
        t.add_row(*(_cell(v) for v in row))
    console.print(t)


def age(ts: float | None) -> str:
    if not ts:
        return "-"
    seconds = max(0, int(time.time() - ts))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def status_summary(status: dict[str, Any]) -> str:
    parts = [f"job {status['job']}: {status['state']}"]
    if status.get("round_no") is not None:
        parts.append(f"round {status['round_no']}")
    parts.append(f"world size {status['world_size']}")
    parts.append(f"desired {status['desired']} in [{status['min_size']}, {status['max_size']}]")
    # The round's worker-failure count (bounded by --max-restarts); the accounting line below it counts
    # re-forms, which membership changes make too.
    failures = status.get("failure_restarts", status.get("restarts"))
    if failures is not None:
        parts.append(f"failure restarts {failures}")
    line = ", ".join(parts)
    return line + (f" ({status['reason']})" if status.get("reason") else "")
