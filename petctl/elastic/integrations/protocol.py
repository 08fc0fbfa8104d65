"""The framework-neutral half of petctl's callbacks: step reports and the save-now protocol.

A framework callback (`transformers.py`, `lightning.py`) calls this at three moments and turns the answer
into its framework's own controls:

- `begin(step)` when training starts (after the framework resumed its checkpoint): marks every worker as
  speaking the protocol (`elastic.<LOCAL_RANK>`), so at a notice or a planned change the agent raises the
  save-now flag instead of SIGTERMing it, and reports where the round resumed (`checkpoint.resumed`);
- `step_end(step)` after each completed optimizer step: reports the step (`train.step`, local rank 0
  speaks for its node: the agent's status, goodput and lost steps read these lines) and answers what to
  do now, the same on every rank (one tiny all-reduce, `SaveNowMonitor`):
  `Action.STOP` (a spot notice, a planned scale change: save this step and leave the training loop),
  `Action.SAVE` (a rebalance recommendation: save this step and train on) or `Action.NONE`;
- `saved(step, where)` after the framework's save returned on this rank: reports the checkpoint
  (`checkpoint.saved`, global rank 0) and, for a save `step_end` asked for, waits for every rank's part of
  the save (a barrier) before telling the agent it is done (`saved.<LOCAL_RANK>`): a node that reported
  early could be re-formed while rank 0 still writes, and be stopped mid-save.

Stdlib and `petctl.elastic` only: the frameworks are imported by their own modules.
"""

from __future__ import annotations

import enum
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from petctl.elastic.autointerval import AutoWire
from petctl.elastic.checkpointer import report_resumed
from petctl.elastic.dist import Comm
from petctl.elastic.workerprotocol import SaveNowMonitor
from petctl.io import controlfiles
from petctl.io.eventlog import EventLog


class Action(enum.Enum):
    """What every rank does at this step boundary (all ranks get the same answer)."""

    NONE = "none"
    SAVE = "save"  # a checkpoint was requested (rebalance recommendation): save, then train on
    STOP = "stop"  # save-now (notice, planned change): save this step, leave the loop, exit 0
    PERIODIC = "periodic"  # every="auto": the durable interval has passed; save, then train on


SAVE_REASONS = {Action.NONE: "periodic", Action.SAVE: "requested", Action.STOP: "save-now",
                Action.PERIODIC: "auto-interval"}


@dataclass
class SaveNowProtocol:
    """One training run's side of the protocol; built when training begins (the process group exists).

    check_every: steps between checks (each is one all-reduce of three flags); 0 disables the save-now
    protocol (steps are still reported and the agent SIGTERMs the workers at a notice, as for any script).
    """

    comm: Comm
    check_every: int = 1
    events: EventLog = field(default_factory=lambda: EventLog(
        "elastic", stream=sys.stdout, node_id=os.environ.get("PETCTL_NODE_ID")))
    monitor: SaveNowMonitor | None = None
    pending: Action = Action.NONE  # the save asked for at the last `step_end`, until `saved` answers it
    stopped_at: int | None = None  # the step the save-now fired at (sticky: later checks are skipped)
    started: float = field(default_factory=time.time)  # when this worker began (the recovery timeline)
    auto: AutoWire | None = None  # every="auto": the durable interval (autointerval.py)
    _last_save: float = field(default_factory=time.monotonic)
    _asked_at: float | None = None  # when this boundary asked for a periodic save (its cost is the wait)

    @classmethod
    def create(cls, check_every: int = 1, started: float | None = None,
               auto: bool = False) -> SaveNowProtocol:
        """For the process group the framework already initialised (or a single process without one).
        auto: keep the durable interval (the framework's own save is timed: its stall is the cost)."""
        proto = cls(comm=Comm.create(), check_every=check_every, started=started or time.time())
        if auto:
            proto.auto = AutoWire(proto.comm.world_size, "replicated" if os.environ.get("PETCTL_SNAPSHOT_DIR")
                                  else "none", proto.events, controlfiles.control_dir_from_env(),
                                  report=proto.comm.rank == 0)
        return proto

    def begin(self, step: int, source: str | None = None) -> None:
        """Training starts at `step` completed steps (the framework's resumed checkpoint, or 0); `source`:
        where that step came from (`resumed_source`)."""
        report_resumed(self.events, self.comm, step, source or resumed_source(step, None), self.started)
        if self.check_every > 0:
            self.monitor = SaveNowMonitor(comm=self.comm, check_every=self.check_every)
            self.monitor.announce()

    def step_end(self, step: int, **fields: object) -> Action:
        """Report completed step `step` and decide, with every rank, what to do at this boundary."""
        if self.comm.local_rank == 0:
            self.events.emit("train.step", step=step, rank=self.comm.rank, world_size=self.comm.world_size,
                             **fields)
        if self.monitor is None or self.stopped_at is not None:
            return self._periodic()
        verdict = self.monitor.check(step)
        if verdict.save_now:
            self.stopped_at = step
            self.events.emit("save_now.detected", step=step, deadline=self.monitor.deadline())
            self.pending = Action.STOP
        elif verdict.checkpoint:
            self.events.emit("checkpoint.requested", step=step, reason=self.monitor.request()[1] or None)
            self.pending = Action.SAVE
        return self.pending if self.pending is not Action.NONE else self._periodic()

    def _periodic(self) -> Action:
        """every="auto": a save when the interval has passed (rank 0's clock, broadcast so all agree)."""
        if self.auto is None:
            return Action.NONE
        due = time.monotonic() - self._last_save >= self.auto.seconds
        if self.comm.distributed:
            due = bool(self.comm.broadcast_object(due))
        if due:
            self.pending, self._asked_at = Action.PERIODIC, time.monotonic()
        return self.pending

    def saved(self, step: int, where: str, seconds: float | None = None) -> None:
        """The framework's checkpoint of `step` is written on this rank (at `where`), in `seconds` when the
        callback timed it: the `checkpoint.saved` line carries it, and a spot notice's hand-off plans its
        save with it (agent/notices.py; without a save time the noticed node hands off at once). Collective
        when `step_end` asked for the save (every rank calls it then); raises what the barrier raises."""
        action, self.pending = self.pending, Action.NONE
        if self.auto is not None and action in (Action.PERIODIC, Action.NONE):
            stall = time.monotonic() - self._asked_at if self._asked_at is not None else 0.0
            self._last_save, self._asked_at = time.monotonic(), None
            if stall > 0:
                self.auto.saved(stall, 0.0, self.comm.world_size)
        if action not in (Action.NONE, Action.PERIODIC):
            self.comm.barrier()  # every rank's part of the save is on disk before anyone reports it
        if self.comm.rank == 0:
            timed = {"seconds": round(seconds, 3)} if seconds is not None else {}
            self.events.emit("checkpoint.saved", step=step, url=where, reason=SAVE_REASONS[action], **timed)
        if self.monitor is None:
            return
        if action is Action.STOP:
            self.monitor.report_saved(step)
            self.events.emit("save_now.saved", step=step)
        elif action is Action.SAVE:
            self.monitor.report_checkpointed(step)


def resumed_source(step: int, from_memory: int | None) -> str:
    """The tier a framework's run resumed from, as `checkpoint.resumed` names it: "snapshot" when the
    in-memory tier handed the framework this very step, "framework" for its own checkpoint on disk, "none"
    for a fresh start. (The bench's lost-step count and `petctl events` read it.)"""
    if step and from_memory == step:
        return "snapshot"
    return "framework" if step else "none"


class ProtocolCallback:
    """What both framework callbacks hold: the protocol, built when training begins."""

    memory: Any = None  # the framework's in-memory tier (`FrameworkSnapshots`), set by its mixin

    def __init__(self, check_every: int = 1, every: str | None = None) -> None:
        if every not in (None, "auto"):
            raise ValueError(f"every: 'auto' or None (the framework's own schedule), not {every!r}")
        self.check_every = check_every
        self.every = every
        self.protocol: SaveNowProtocol | None = None

    @property
    def stopped(self) -> bool:
        """Whether training ended at petctl's save-now flag rather than at its last step: a script can
        skip what it runs after training (a final evaluation, an export) when it did."""
        return self.protocol is not None and self.protocol.stopped_at is not None

    def start(self, step: int) -> None:
        """Training begins at `step` completed steps (after the framework restored its checkpoint)."""
        self.protocol = SaveNowProtocol.create(check_every=self.check_every, auto=self.every == "auto")
        source = resumed_source(step, None if self.memory is None else self.memory.resumed)
        self.protocol.begin(step, source)
        if self.protocol.auto is not None and self.protocol.comm.rank == 0:
            self.protocol.auto.resumed(source, self.protocol.comm.world_size)
