"""The in-memory snapshot tier: a node lost costs at most one step (docs/elastic.md).

This package holds the replicated tier (`SnapshotTier`) and the options both tiers share
(`SnapshotOptions`); its modules: `writer` (the snapshot file, its cadence, the device copy), `codec` (the
wire formats, replicated and sharded, and the shard file), `resume` (offers, the choice and the resume,
replicated and sharded side by side), `ring` (the sharded tier: capture, the ring, `ShardSnapshotTier`).

The in-memory snapshot tier of `Checkpointer`: a node loses at most one step when another node vanishes.

Under a petctl agent every node has a tmpfs directory the agent owns (`$PETCTL_SNAPSHOT_DIR`, kept for the
agent's life, removed when it exits). At every step boundary (or every K steps, see `SnapshotOptions`)
local rank 0 of each node copies the training state into one file there (`writer`): under DDP every
rank holds the same state, so one copy per node is enough, and it outlives the worker. When the job
re-forms, its workers resume from the newest snapshot any survivor holds if it is at least as new as the
store's newest checkpoint (`resume`), and from the store otherwise.

The store stays the durable tier: periodic saves go on at the user's interval, and a new job, a new agent
(a restart of the whole node or job) or a job's end never sees an old snapshot (the directory is the
agent's, and a header names its job and round).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl.core.snapshotrecord import ENV_SNAPSHOT_DIR, snapshot_path
from petctl.elastic.snapshots.resume import SnapshotReader, resume_from_snapshot
from petctl.elastic.snapshots.writer import SnapshotWriter
from petctl.io.eventlog import EventLog

ENV_SWITCH = "PETCTL_SNAPSHOTS"  # "0"/"off": no snapshots for this job (`petctl run_job --env`), as False
ENV_JOB = "PETCTL_JOB"
ENV_ROUND = "PETCTL_ROUND"
REPLICATED = "state"  # the file of a replicated (DDP) state: `state.snap`


@dataclass(frozen=True)
class SnapshotOptions:
    """How `Checkpointer` keeps in-memory snapshots.

    enabled: None (default): when the agent provides a directory ($PETCTL_SNAPSHOT_DIR) and the job's
        environment does not say PETCTL_SNAPSHOTS=0; False: never.
    every: a snapshot every `every` steps; None (default): as often as `budget` allows, from the
        measured cost (every step when the copy overlaps the next step, as it does for 100 MB on a
        100 ms step).
    overlap: copy parameters and optimizer state in the background while the next step computes, and
        hold the next `optimizer.step()` until it is done. Set False if your loop changes parameters
        outside `optimizer.step()` (an in-place EMA, weight clipping) between two steps.
    budget: the share of step time the training thread may spend on snapshots when `every` is None.
    directory: overrides $PETCTL_SNAPSHOT_DIR (tests, benchmarks).
    """

    enabled: bool | None = None
    every: int | None = None
    overlap: bool = True
    budget: float = 0.01
    directory: str | None = None

    @classmethod
    def of(cls, value: SnapshotOptions | bool | None) -> SnapshotOptions:
        if isinstance(value, SnapshotOptions):
            return value
        return cls(enabled=value)

    def validate(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"snapshot every must be >= 1 (got {self.every})")
        if not 0 < self.budget <= 1:
            raise ValueError(f"snapshot budget must be in (0, 1] (got {self.budget})")


def resolve(options: SnapshotOptions | bool | None,
            environ: dict[str, str] | None = None) -> tuple[SnapshotOptions, str, Any]:
    """(options, the snapshot directory or "", the environment) for a tier: off with `False` or
    PETCTL_SNAPSHOTS=0 in the job's environment. Raises ValueError on bad options, or on `enabled=True`
    with no directory."""
    env = os.environ if environ is None else environ
    opts = SnapshotOptions.of(options)
    opts.validate()
    if opts.enabled is None and env.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "false", "no"):
        opts = dataclasses.replace(opts, enabled=False)
    directory = opts.directory or env.get(ENV_SNAPSHOT_DIR, "")
    if opts.enabled and not directory:
        raise ValueError(f"snapshots enabled but no directory: pass SnapshotOptions(directory=...) or "
                         f"run under the petctl agent (${ENV_SNAPSHOT_DIR})")
    return opts, directory, env


class SnapshotTier:
    """This rank's part: a writer and a reader on local rank 0 when enabled; every rank takes part in
    the resume's offer exchange unless snapshots are switched off in code (the same on every rank).
    `name`: the file in the node's directory (`state.snap` for `Checkpointer`; the framework callbacks
    keep theirs apart, `framework.snap`)."""

    def __init__(self, comm: Any, log: EventLog, options: SnapshotOptions | bool | None = None,
                 environ: dict[str, str] | None = None, name: str = REPLICATED) -> None:
        opts, directory, env = resolve(options, environ)
        self.comm = comm
        self.log = log
        self.exchange = opts.enabled is not False and (comm.distributed or bool(directory))
        self.writer: SnapshotWriter | None = None
        self.reader: SnapshotReader | None = None
        if opts.enabled is False or not directory or comm.local_rank != 0:
            return
        path = snapshot_path(directory, name)
        job = env.get(ENV_JOB, "")
        round_no = _int(env.get(ENV_ROUND))
        self.reader = SnapshotReader(path, job, round_no, comm.rank, log)
        self.writer = SnapshotWriter(Path(path), job, round_no, comm.rank, comm.world_size, log,
                                     every=opts.every, overlap=opts.overlap, budget=opts.budget)

    def take(self, step: int, state: Any) -> None:
        """At the end of `step`: snapshot the state when one is due (local rank 0 only)."""
        if self.writer is not None:
            self.writer.take(step, state)

    def prepare(self, state: Any) -> None:
        """After the resume: get the snapshot memory ready in the background (local rank 0 only)."""
        if self.writer is not None:
            self.writer.prepare(state)

    def resume(self, store_step: Callable[[], int | None],
               weights_only: bool = True) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the snapshot the job resumes from, or None for the store (collective)."""
        if not self.exchange:
            return None
        return resume_from_snapshot(self.comm, self.log, self.reader, store_step, weights_only)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
