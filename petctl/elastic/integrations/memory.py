"""The in-memory snapshot tier for the framework callbacks: what `Checkpointer` users get, for a Trainer.

A node lost without warning (a vanished host, a SIGKILL) gives nobody time to save, so a framework job
used to redo every step since its last periodic checkpoint. Under the petctl agent the callbacks now keep
the framework's own checkpoint of the newest step in node memory, as `Checkpointer` keeps its `State`
(`petctl.elastic.snapshots`): local rank 0 of each node writes it at every step boundary (or every K
steps, from the measured cost) into `framework.snap` in the agent's tmpfs directory, and a re-formed
job's workers resume from the newest step any survivor holds when it is at least as new as the newest
checkpoint on disk. The framework's own halves say what "its checkpoint" is and how it is resumed:
`transformers.py` (the Trainer's `checkpoint-N` contents) and `lightning.py` (Lightning's checkpoint dict).

The payload is the framework's checkpoint, objects and all, so it is read back with `weights_only=False`
(the framework itself loads its own checkpoints that way); it is written by this job's own workers into
a directory only the agent's user can read (mode 0700), and its header names the job and round.
Stdlib and `petctl.elastic` only: the frameworks are imported by their own modules.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from petctl.elastic.dist import Comm
from petctl.elastic.snapshots import SnapshotOptions, SnapshotTier
from petctl.io.eventlog import EventLog

NAME = "framework"  # the file in the node's snapshot directory: framework.snap
# The default cost budget: the framework builds its checkpoint dict on the training thread (Lightning's
# dump: about 1-3 ms for a small model), which a toy's padded step would make K > 1 at Checkpointer's 1 %.
BUDGET = 0.05


class _Due:
    """What `SnapshotWriter.take` reads: `state_dict()` is built only when a snapshot is due, and
    `optimizer` (its parameters and state are copied beside the next step when large; None: at the
    step end)."""

    def __init__(self, build: Callable[[], dict[str, Any]], optimizer: Any) -> None:
        self.build, self.optimizer = build, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.build()


class FrameworkSnapshots:
    """This rank's part of the framework tier (see the module). `create` is collective only in that
    `Comm.create` may make a gloo group (a job on NCCL); `resume` is collective: every rank calls it."""

    def __init__(self, comm: Comm, log: EventLog, options: SnapshotOptions | bool | None = None) -> None:
        self.comm, self.log = comm, log
        self.tier = SnapshotTier(comm, log, SnapshotOptions(budget=BUDGET) if options is None else options,
                                 name=NAME)
        self.resumed: int | None = None  # the step the job resumed from memory at, if it did

    @classmethod
    def create(cls, options: SnapshotOptions | bool | None = None) -> FrameworkSnapshots:
        comm = Comm.create()
        return cls(comm, EventLog("elastic", stream=sys.stdout, rank=comm.rank,
                                  node_id=os.environ.get("PETCTL_NODE_ID")), options)

    @property
    def writing(self) -> bool:
        """Whether this rank keeps its node's snapshot (local rank 0, under the agent, enabled)."""
        return self.tier.writer is not None

    def take(self, step: int, build: Callable[[], dict[str, Any]], optimizer: Any = None) -> None:
        """At the end of completed step `step`: snapshot `build()` when one is due (local rank 0)."""
        if self.tier.writer is not None:
            self.tier.take(step, _Due(build, optimizer))

    def resume(self, newest_on_disk: Callable[[], int | None]) -> tuple[int, dict[str, Any]] | None:
        """(step, the framework's checkpoint) from the newest snapshot any rank holds, when it is at least
        as new as `newest_on_disk()` (called on rank 0 only); None: resume from disk (or fresh).
        Collective; raises nothing (a snapshot that cannot be read is reported and skipped)."""
        taken = self.tier.resume(newest_on_disk, weights_only=False)
        self.resumed = None if taken is None else taken[0]
        return taken

    def close(self) -> None:
        """Commit the snapshot in flight; the file stays (the agent's directory owns it)."""
        self.tier.close()
