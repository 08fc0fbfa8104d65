"""What a node tells the world about itself: its `NodeStatus`, in etcd and in the mirror.

`petctl status` shows it per node: state, round, rank, the newest step and checkpoint, the etcd requests
the agent made, the failures its services counted, and the last failed worker's error lines. It is
informational: a failed publication is counted and reported once per outage (outage.py), never allowed
to stop training.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import etcd

from petctl.agent.outage import OutageReporter
from petctl.agent.view import RoundInfo
from petctl.agent.watcher import RequestStats
from petctl.core.eventlog import EventLog
from petctl.core.keys import JobKeys
from petctl.core.records import Checkpoint, NodeStatus
from petctl.io.etcd import store_errors

STATUS_TTL = 120
FORWARDED = ("checkpoint.saved", "checkpoint.loaded", "train.resumed", "checkpoint.interval")


class Progress:
    """Follows the workers' progress lines (local rank 0 speaks for the node); no torch needed."""

    def __init__(self, nproc: int, events: EventLog) -> None:
        self.nproc = nproc
        self.events = events
        self.step: int | None = None
        self.last_checkpoint: Checkpoint | None = None
        self.round_step_seen = False  # a step was logged in the current round
        self.span: dict[str, Any] = {}  # first/last step of the current round (goodput)
        self.last_step_at: float | None = None  # monotonic: the round's latest step (fencing.py)
        self.longest_gap = 0.0  # the round's longest time between two steps
        self.progress_at: float | None = None  # monotonic: the round's latest event of any worker
        self.reporting = False  # the workers ever reported progress (events): the hang watchdog's default

    def begin_round(self) -> None:
        self.span = {}
        self.round_step_seen = False
        self.last_step_at = None
        self.longest_gap = 0.0
        self.progress_at = None

    def stalled_for(self, now: float) -> float | None:
        """Seconds since the round's latest step; None when the workers reported none this round."""
        return None if self.last_step_at is None else now - self.last_step_at

    def on_worker_event(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        self.progress_at, self.reporting = time.monotonic(), True  # any worker's event is progress
        if int(record.get("local_rank", record.get("rank", 0)) or 0) % self.nproc != 0:
            return
        if event == "train.step":
            step, ts = record.get("step"), record.get("ts")
            self.step = step
            self.round_step_seen = True
            now = time.monotonic()
            if self.last_step_at is not None:
                self.longest_gap = max(self.longest_gap, now - self.last_step_at)
            self.last_step_at = now
            if "first" not in self.span:
                self.span.update(first=step, first_ts=ts)
            self.span.update(last=step, last_ts=ts)
        elif event in FORWARDED:
            last = self.last_checkpoint or Checkpoint(step=None)
            if event == "checkpoint.saved":
                self.last_checkpoint = Checkpoint(step=record.get("step"), url=record.get("url"),
                                                  interval_s=last.interval_s,
                                                  interval_reason=last.interval_reason)
            elif event == "checkpoint.interval":  # every="auto" chose (or changed) the durable interval
                self.last_checkpoint = Checkpoint(step=last.step, url=last.url,
                                                  interval_s=record.get("interval_s"),
                                                  interval_reason=str(record.get("reason", "")))
            self.events.forward(record)


class StatusPublisher:
    """Publishes the node's status at each state change and whenever `publish()` is called."""

    def __init__(self, client: etcd.Client, keys: JobKeys, node_id: str, host_addr: str, stats: RequestStats,
                 progress: Progress, outage: OutageReporter,
                 failures: Callable[[], dict[str, int]] = dict, mirror: Any = None) -> None:
        self.client = client
        self.key = keys.node_status(node_id)
        self.node_id = node_id
        self.host_addr = host_addr
        self.stats = stats
        self.progress = progress
        self.outage = outage
        self.failures = failures
        self.mirror = mirror
        self.state = "starting"
        self.round: RoundInfo | None = None
        self.last_error: list[str] = []  # the last failed worker's error lines (NodeStatus.last_error)

    def set_state(self, state: str) -> None:
        self.state = state
        self.publish()

    def status(self) -> NodeStatus:
        info = self.round if self.state not in ("joining", "waiting") else None
        return NodeStatus(node_id=self.node_id, state=self.state, updated=time.time(),
                          host_addr=self.host_addr, pid=os.getpid(),
                          round=self.round.round if self.round else None,
                          rank=info.rank if info else None, world_size=info.world_size if info else None,
                          restarts=info.restarts if info else None, step=self.progress.step,
                          last_checkpoint=self.progress.last_checkpoint,
                          etcd_requests=self.stats.as_dict(), failures=self.failures(),
                          last_error=list(self.last_error))

    def publish(self) -> None:
        status = self.status()
        if self.mirror is not None:
            self.mirror.set_status(status.to_dict())
        t0 = time.monotonic()
        try:
            self.client.write(self.key, status.to_json(), ttl=STATUS_TTL)
        except store_errors() as e:
            self.outage.failed(e)
            return
        self.outage.succeeded(time.monotonic() - t0)
