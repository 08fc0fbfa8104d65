"""When a node cut off from etcd must stop its own workers: the fence, as a pure rule.

A node that cannot reach etcd cannot tell a store outage (every node cut off, the job healthy) from its
own partition (the others reached etcd, dropped it after one heartbeat TTL and re-formed without it). What
tells them apart is its workers: in a store outage the collectives still complete and steps keep coming;
cut off from its peers, a worker blocks in its next collective. So the node fences itself only when both
hold: etcd has not answered for longer than the heartbeat TTL (the others may have dropped it by now), and
its workers, which did report steps this round, have reported none for longer than `stall_limit`.

Fenced, the agent writes the fence control file (a worker never commits a checkpoint while it exists:
core/controlfiles.py), stops its workers, and rejoins once etcd answers. A script that reports no steps
is never fenced on a stall (nothing tells a stall from a quiet phase); it is stopped when etcd answers and
shows the round has moved on, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from petctl.core import controlfiles
from petctl.core.eventlog import EventLog

STALL_TTLS = 2.0  # a stall is at least this many heartbeat TTLs ...
STALL_GAPS = 4.0  # ... and this many of the round's longest gap between two steps


@dataclass(frozen=True)
class FenceLook:
    """What the round runner knows when it asks."""

    unreachable_for: float | None  # seconds etcd has failed without one success; None: it answers
    stalled_for: float | None  # seconds since the workers' last step; None: no step reported this round
    longest_gap: float  # the longest time between two steps this round (slow steps are not stalls)
    workers_running: bool


def stall_limit(ttl: float, longest_gap: float) -> float:
    """How long without a step is a stall, for a job whose steps take up to `longest_gap`."""
    return max(STALL_TTLS * ttl, STALL_GAPS * longest_gap)


def should_fence(look: FenceLook, ttl: float) -> bool:
    """True when this node must assume it was dropped from its round (see the module docstring)."""
    if look.unreachable_for is None or look.stalled_for is None or not look.workers_running:
        return False
    return look.unreachable_for > ttl and look.stalled_for > stall_limit(ttl, look.longest_gap)


def fence(look: FenceLook, round_no: int, control_dir: Path, events: EventLog,
          stop_workers: Callable[[], dict[int, int]]) -> None:
    """Fence this node: the fence file first (no worker commits a checkpoint from then on), then one
    `agent.fenced` line, then stop the workers."""
    reason = (f"etcd unreachable for {look.unreachable_for or 0:.1f}s and no step for "
              f"{look.stalled_for or 0:.1f}s: this node may have been dropped from round {round_no}")
    controlfiles.write_fence(control_dir, round_no, reason)
    events.emit("agent.fenced", round=round_no, unreachable_for=round(look.unreachable_for or 0, 3),
                stalled_for=round(look.stalled_for or 0, 3))
    codes = stop_workers()
    events.emit("workers.stopped", round=round_no, why="fenced", codes=codes)
