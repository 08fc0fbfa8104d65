"""One structured line per event: the format, and reading it back (`EventLog`, in io/, writes it).

Every component (agent, reconciler, CLI) reports what happened as a single JSON object on one line:
`{"ts": <unix seconds>, "event": "<area>.<what>", ...fields}`. Humans can grep it, `petctl events` and the
benchmark parse it back (`parse_line`), and nothing depends on log formatting elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

EVENT_START = '{"ts":'  # how every line `petctl.io.eventlog.EventLog` writes begins


def parse_line(line: str) -> dict[str, Any] | None:
    """The event on this log line, or None if the line is not an event (worker output, say).

    An event may share its line with what another stream of the same process wrote without a newline
    just before it: a progress bar (tqdm, the Hugging Face Trainer's default) redraws itself with `\r`
    and no `\n` on stderr, which the agent reads merged with stdout, so `\r 8%|...| 1/12{"ts": ...}`
    is one line there. Every event this module writes starts with `{"ts":`, so the event is read from
    there: losing those lines lost a round's first and last steps (its kept and lost steps)."""
    line = line.strip()
    if '"event"' not in line:
        return None
    if not line.startswith("{"):
        start = line.find(EVENT_START)
        if start < 0:
            return None
        line = line[start:]
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "event" in record and "ts" in record else None


def parse_lines(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        record = parse_line(line)
        if record is not None:
            yield record


def dedupe(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same event read from two copies (etcd and the mirror) counts once: same time, node, name."""
    seen: set[tuple] = set()
    out = []
    for e in events:
        key = (e.get("ts"), e.get("node"), e.get("event"))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out
