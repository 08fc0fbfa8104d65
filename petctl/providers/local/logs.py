"""Reading (and following) a local job's node logs.

Only complete lines are returned, so a line being written is never split; when following, instances
launched later (replacements, scale-out) are picked up as their logs appear, and the stream ends once
the job is over and every log has been read to its end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from petctl.core.errors import PetctlError
from petctl.core.eventlog import parse_lines
from petctl.providers.local.jobdir import JobDir


def _sources(job: JobDir, node: str | None) -> dict[str, Path]:
    if node == "reconciler":
        return {"reconciler": job.reconciler_log}
    if node is not None:
        if not job.instance(node).exists():
            raise PetctlError(f"no node {node!r} in job {job.name!r} (see `petctl hosts {job.name}`)")
        return {node: job.agent_log(node)}
    order = {row["id"]: i for i, row in enumerate(job.read_instances())}
    dirs = sorted((job.path / "instances").glob("*/agent.log"),
                  key=lambda p: (order.get(p.parent.name, len(order)), p.parent.name))
    return {p.parent.name: p for p in dirs}


def follow_logs(job: JobDir, node: str | None, follow: bool, running: Callable[[], bool],
                poll: float = 0.3) -> Iterator[str]:
    """Lines of the job's logs, prefixed `[node] ` unless one node was asked for."""
    _sources(job, node)  # fail early on an unknown node
    offsets: dict[str, int] = {}
    partial: dict[str, bytes] = {}
    finished_passes = 0
    while True:
        got = False
        for name, path in _sources(job, node).items():
            try:
                with open(path, "rb") as f:
                    f.seek(offsets.get(name, 0))
                    data = f.read()
                    offsets[name] = f.tell()
            except OSError:
                continue
            data = partial.pop(name, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                partial[name] = lines[-1]
            for raw in lines[:-1]:
                got = True
                line = raw.decode("utf-8", "replace")
                yield line if node is not None else f"[{name}] {line}"
        if not follow:
            for name, rest in partial.items():  # a final line without newline, when not following
                yield rest.decode("utf-8", "replace") if node is not None else f"[{name}] {rest.decode()}"
            return
        if not got:
            finished_passes = finished_passes + 1 if not running() else 0
            if finished_passes >= 2:
                return
        time.sleep(poll)


def reconciler_events(job: JobDir) -> list[dict[str, Any]]:
    """The reconciler's own events (instances launched and terminated, scaling), from its log."""
    try:
        with open(job.reconciler_log, errors="replace") as f:
            return list(parse_lines(f))
    except FileNotFoundError:
        return []
