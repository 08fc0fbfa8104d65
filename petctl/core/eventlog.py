"""One structured line per event: the format, and reading it back (`EventLog`, in io/, writes it).

Every component (agent, reconciler, CLI) reports what happened as a single JSON object on one line:
`{"ts": <unix seconds>, "event": "<area>.<what>", ...fields}`. Humans can grep it, `petctl events` and the
benchmark parse it back (`parse_line`), and nothing depends on log formatting elsewhere.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

EVENT_START = '{"ts":'  # how every line `petctl.io.eventlog.EventLog` writes begins
_EVENT_START = re.compile(r'\{\s*"ts"\s*:')  # the same, or as `json.dumps` writes it by default
_DECODER = json.JSONDecoder()


def parse_events(line: str) -> list[dict[str, Any]]:
    """Every event on this log line, in order; [] when it holds none (worker output, say).

    An event may share its line with what else the same process wrote without a newline:
    - a progress bar (tqdm, the Hugging Face Trainer's default) redraws itself with `\r` and no `\n` on
      stderr, which the agent reads merged with stdout, so `\r 8%|...| 1/12{"ts": ...}` is one line there;
    - another thread's event: Python's `print` writes the text and its newline apart, so a line the
      script prints and the one petctl's background save writes can land as `{...}{...}` and one `\n`.
    Losing those lines lost a round's first and last steps, and a save's `checkpoint.saved`. So each
    object that starts like an event (`{"ts":`, with or without spaces) is read where it starts, and
    one line may hold several."""
    line = line.strip()
    if '"event"' not in line:
        return []
    out: list[dict[str, Any]] = []
    match = 0 if line.startswith("{") else _next_start(line, 0)
    while match is not None:
        try:
            record, end = _DECODER.raw_decode(line, match)
        except ValueError:
            match = _next_start(line, match + 1)
            continue
        if isinstance(record, dict) and "event" in record and "ts" in record:
            out.append(record)
        match = _next_start(line, end)
    return out


def parse_line(line: str) -> dict[str, Any] | None:
    """The first event on this log line (`parse_events`), or None if it holds none."""
    events = parse_events(line)
    return events[0] if events else None


def _next_start(line: str, pos: int) -> int | None:
    found = _EVENT_START.search(line, pos)
    return found.start() if found else None


def parse_lines(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        yield from parse_events(line)


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
