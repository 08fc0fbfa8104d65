"""An `emit(event, **fields)` callable that keeps what it was given, for the agent services that report
through one (the outage reporter, the watchers, the event sinks)."""

from __future__ import annotations


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def __call__(self, event: str, **fields) -> None:
        self.events.append((event, fields))

    def names(self) -> list[str]:
        return [e for e, _ in self.events]
