"""Counting the stored records the read side had to skip.

A record another agent wrote half-way, by an incompatible version, or by hand must never crash
`petctl status`; but a skipped record is a fact the user should see, so each one is counted by kind and
the first error of each kind is kept for the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Corrupt:
    """Records skipped because they did not parse: kind -> count, and the first error of each kind."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, kind: str, error: object) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.first.setdefault(kind, str(error))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def note(self) -> str:
        """One line for people ("" when nothing was skipped)."""
        if not self.counts:
            return ""
        kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.counts.items()))
        example = next(iter(self.first.values()))
        return f"skipped {self.total} corrupt record(s) ({kinds}); first: {example}"

    def to_dict(self) -> dict[str, int]:
        return dict(self.counts)
