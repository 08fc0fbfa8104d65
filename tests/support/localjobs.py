"""What the end-to-end tests of local jobs share: fast failure detection, the example script, and the
status predicates they wait on."""

from __future__ import annotations

from typing import Any

from tests.support.paths import EXAMPLES

# Fast failure detection for tests (the defaults favour a LAN with real machines).
FAST = ["--timeout", "heartbeat_ttl=2", "--timeout", "last_call=0.5",
        "--timeout", "stop_grace=2"]
TRAIN = str(EXAMPLES / "train_ddp.py")


def world(status: dict[str, Any]) -> list[int]:
    return sorted(status["ranks"].values())


def formed(size: int):
    """Status predicate: the current round has ranks 0..size-1 and every member is training in it."""
    def check(status: dict[str, Any]) -> bool:
        if world(status) != list(range(size)):
            return False
        members = [status["nodes"].get(n, {}) for n in status["ranks"]]
        return all(m.get("state") == "running" and m.get("world_size") == size for m in members)
    return check
