"""Why a job failed, in its failing worker's own words: the error lines its agent captured.

When a worker exits non-zero, its agent emits `workers.failed` with the worker's last lines that were not
events (`last_error`: its traceback, its `RuntimeError: ...`). `petctl status` shows them for a failed job,
so "max_restarts=3 exhausted" comes with the reason the restarts were spent, without opening the logs.

Which failure: the last round that had one (the failure that used up the restarts), and in that round the
first report that is not an echo. When one rank dies, its peers fail next in their collectives ("Connection
closed by peer"): those are echoes, recognised by the backend's words for a peer gone (`ECHOES`). Order
alone cannot tell them apart: each agent notices its workers' exit at its own next poll, so on a loaded
host the echo may be reported first (it was, in a full suite run on 2 cores). The first report wins only when
every report is an echo, or none is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MAX_LINES = 20  # what status prints at most (the agent keeps no more either)

# Errors whose cause is petctl's elasticity rather than the script's logic, and the one line that says
# what to change: (text in the worker's error lines, advice).
HINTS: tuple[tuple[str, str], ...] = (
    ("does not match the world size", "hint: Lightning's num_nodes must follow the world size, which changes "
     "between rounds: num_nodes=num_nodes(), devices=devices_per_node() from "
     "petctl.elastic.integrations.lightning (docs/elastic.md)"),
)


# What a worker's collective says when a peer died under it rather than of its own fault: gloo's TCP pair,
# and NCCL's remote error (torch's message for ncclRemoteError).
ECHOES: tuple[str, ...] = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
    "ncclRemoteError",
)


@dataclass(frozen=True)
class WorkerFailure:
    node: str
    round: int | None
    local_rank: int | None
    code: int | None
    ts: float
    lines: list[str] = field(default_factory=list)  # the worker's last error lines, oldest first
    others: int = 0  # other nodes whose workers failed in the same round after this one

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hint": self.hint()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerFailure:
        """The record `to_dict` wrote; its derived keys (`hint`) are recomputed, not read."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def heading(self) -> str:
        echo = f"; {self.others} other node(s) failed after it" if self.others else ""
        return (f"last worker error (node {self.node}, round {self.round}, local rank {self.local_rank}, "
                f"exit code {self.code}{echo}):")

    def hint(self) -> str | None:
        """One line of advice when the error is a known clash with elastic membership, else None."""
        return next((advice for text, advice in HINTS if any(text in line for line in self.lines)), None)

    def block(self, indent: str = "    ") -> list[str]:
        """The heading and the error lines, indented, at most MAX_LINES of them, and the hint if any."""
        body = self.lines[-MAX_LINES:] or ["(the worker printed nothing but events)"]
        hint = self.hint()
        return [self.heading(), *(indent + line for line in body), *([hint] if hint else [])]


def last_failure(events: Iterable[dict[str, Any]]) -> WorkerFailure | None:
    """The first `workers.failed` report of the last round that had one, an echo only when every report
    is (the module docstring); None when no worker failed."""
    failed = [e for e in events if e.get("event") == "workers.failed"]
    if not failed:
        return None
    last_round = max(_round(e) for e in failed)
    in_round = sorted((e for e in failed if _round(e) == last_round), key=lambda e: float(e.get("ts", 0.0)))
    first = next((e for e in in_round if not is_echo(e)), in_round[0])
    lines = first.get("last_error")
    return WorkerFailure(node=str(first.get("node", "")), round=first.get("round"),
                         local_rank=first.get("local_rank"), code=first.get("code"),
                         ts=float(first.get("ts", 0.0)),
                         lines=[str(line) for line in lines][-MAX_LINES:] if isinstance(lines, list) else [],
                         others=len({e.get("node") for e in in_round} - {first.get("node")}))


def is_echo(event: dict[str, Any]) -> bool:
    """Whether a `workers.failed` report's error lines say a peer died under the worker (`ECHOES`)."""
    lines = event.get("last_error")
    return isinstance(lines, list) and any(sign in str(line) for line in lines for sign in ECHOES)


def _round(event: dict[str, Any]) -> int:
    value = event.get("round")
    return value if isinstance(value, int) else -1
