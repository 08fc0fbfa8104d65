"""The in-memory snapshot tier of `ShardedCheckpointer`: one node lost costs at most one step, also when
every rank holds only a shard of the state.

Every K steps each rank keeps its own shard in its node's memory (the agent's tmpfs directory,
$PETCTL_SNAPSHOT_DIR) and sends a copy to the same local rank on the next node in rank order (rank +
local world size, mod world), which keeps it as its peer shard: a node lost takes one shard and one
peer copy with it, and the shard it lost is still held by the next node. Per rank: one own shard and one
peer shard, the newest only.

How a snapshot runs, so the training thread pays little:
- training thread (`take`): the state dict (every rank, the same step: FSDP's `get_state_dict` may run
  collectives), clones of what the next forward could change (buffers, extras), each DTensor as its
  local tensor and offset, a pickled skeleton (`shardcodec`), and a hand-off;
- background thread: the tensors' bytes copied into the shard file's buffer (`shardbundle.pack`) straight
  from the live parameters and optimizer state, which only `optimizer.step()` changes: a pre-hook holds
  the next `step()` until the capture is done (as the DDP tier does);
- then, on a gloo group of its own (made collectively when the checkpointer is made), the ranks agree on
  the next K and on whether every capture worked (one all-reduce), swap shards with their ring
  neighbours (isend/irecv), stage both files, agree that everyone has both (one more all-reduce), and
  only then rename both into place: a kill at any moment leaves, for every shard, the new save or the old
  one complete on two nodes. Every rank takes its snapshots at the same steps (K is agreed), so the
  group's operations come in the same order everywhere.
A capture that fails on any rank switches the tier off on every rank (`snapshot.disabled`); training goes
on with the store alone.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from petctl.core.eventlog import EventLog
from petctl.elastic.background import yield_cpu_to_training
from petctl.elastic.shardbundle import OWN, PEER, pack, shard_path
from petctl.elastic.shardcodec import encode
from petctl.elastic.shardresume import ShardReader, resume_sharded
from petctl.elastic.shardring import ShardRing, exchange
from petctl.elastic.shardstate import StateDicts, detach_for_capture, find_optimizers
from petctl.elastic.snapcadence import Cadence
from petctl.elastic.snapshot import ENV_JOB, ENV_ROUND, SnapshotOptions, resolve

Captured = tuple[bytearray | None, str | None]  # a sealed shard file, or why there is none
INLINE_BYTES = 1 << 20  # a shard this small is cloned on the training thread and encoded by the ring thread
FAILURES = (OSError, ValueError, RuntimeError, TypeError, KeyError, AttributeError)


class ShardSnapshotTier:
    """This rank's part (see the module). `exchange`: it takes part in the resume's offer exchange;
    `writer`: it takes snapshots (every rank does, or none: agreed when it is made)."""

    def __init__(self, comm: Any, log: EventLog, options: SnapshotOptions | bool | None = None,
                 environ: dict[str, str] | None = None) -> None:
        opts, directory, env = resolve(options, environ)
        self.comm, self.log = comm, log
        self.job, self.round = env.get(ENV_JOB, ""), _int(env.get(ENV_ROUND))
        self.directory = Path(directory) if directory else None
        self.exchange = opts.enabled is not False and (comm.distributed or bool(directory))
        self.writer = opts.enabled is not False and bool(directory)
        if comm.distributed and opts.enabled is not False:  # every rank captures, or none does
            self.writer = not comm.any_true(not self.writer)
        self.ring = ShardRing.create(comm, _int(env.get("LOCAL_WORLD_SIZE")) or 1) if self.writer else None
        self.cadence = Cadence(fixed=opts.every, budget=opts.budget)
        self.overlap = opts.overlap
        self.every = self.cadence.every  # agreed by every rank
        self.due = 1
        self.disabled: str | None = None
        self.taken = 0
        self.stats = {"blocked_s": 0.0, "hook_wait_s": 0.0, "capture_s": 0.0, "exchange_s": 0.0, "bytes": 0}
        # Two threads, each running its jobs in order: a copy (large shards) never waits behind the
        # previous snapshot's exchange, and the exchanges reach the ring group in the same order everywhere.
        self._copier = ThreadPoolExecutor(1, "petctl-shardcopy", initializer=yield_cpu_to_training)
        # The ring thread is not niced: its round is mostly waiting on the neighbours, and a round that
        # lags behind the steps (a starved thread on a loaded machine) is a step more lost on a kill.
        self._sender = ThreadPoolExecutor(1, "petctl-shardring")
        self._inflight: deque[tuple[int, Future[tuple[str | None, int]]]] = deque()
        self._captured = threading.Event()
        self._captured.set()
        self._hooks: list[Any] = []
        self._hooked: list[Any] = []
        self._last_cost = 0.0
        self._offsets: dict[Any, list[int]] = {}  # where this rank's DTensor pieces sit
        self._state_dicts = StateDicts()
        self._small = False  # the last shard was small (a local choice: how, never when, to snapshot)

    def resume(self, app_state: dict[str, Any], store_step: Callable[[], int | None]) -> int | None:
        """The step loaded from the shards in memory, or None for the store (collective)."""
        if not self.exchange:
            return None
        reader = None
        if self.directory is not None:
            reader = ShardReader(self.directory, self.comm.local_rank, self.comm.rank, self.job, self.round,
                                 self.log)
        return resume_sharded(self.comm, self.log, reader, app_state, store_step)

    # --- the training thread ---------------------------------------------------------------------
    def take(self, step: int, app_state: dict[str, Any]) -> bool:
        """At the end of `step` (every rank): start this step's snapshot when one is due. True when one
        was started. Never raises: a failure switches snapshots off on every rank, reported once."""
        if not self.writer or self.directory is None:
            return False
        self.cadence.step_ended(time.monotonic())
        self.due -= 1
        if self.due > 0 or self.disabled is not None:
            return False
        t0 = time.monotonic()
        self._finish(before=self.taken - 1)  # all but the previous one: also where K was agreed
        if self.disabled is not None:
            return False
        if self.taken:
            changed = self.cadence.record(self._last_cost)
            if changed is not None:
                self.log.emit("snapshot.every", step=step, proposed=changed[0], was=changed[1],
                              cost_ms=round(1e3 * changed[2], 3), step_ms=round(1e3 * changed[3], 3))
        waited, cpu0 = time.monotonic() - t0, time.thread_time()
        small = self._small  # the previous shard was small: copy every tensor now, encode on the ring thread
        encoded: Any = None
        error = None
        try:
            captured = detach_for_capture(app_state, self.overlap and not small, self._offsets,
                                          self._state_dicts)
            encoded = ("raw", captured) if small else ("encoded", *encode(captured))
        except FAILURES as e:  # the others wait in the exchange: say so there
            encoded, error = None, f"{type(e).__name__}: {e}"
        if encoded is not None and encoded[0] == "encoded":  # a copy thread's: hold the next step for it
            self._hook(app_state)
            self._captured.clear()
            copy: Any = self._copier.submit(self._capture, step, encoded, error)
        else:
            copy = (step, encoded, error)  # made by the ring thread itself: one hand-off
        self._inflight.append((self.taken, self._sender.submit(self._exchange, copy, self.cadence.every)))
        self.due = self.every
        self.taken += 1
        self._last_cost = waited + time.thread_time() - cpu0
        self.stats["blocked_s"] += time.monotonic() - t0
        return True

    def _hook(self, app_state: dict[str, Any]) -> None:
        optimizers = find_optimizers(app_state) if self.overlap else []
        if [id(o) for o in optimizers] == [id(o) for o in self._hooked]:
            return
        self._unhook()
        self._hooked = optimizers
        self._hooks = [o.register_step_pre_hook(self._before_optimizer_step) for o in optimizers]

    def _before_optimizer_step(self, *_: Any) -> None:
        if not self._captured.is_set():
            t0 = time.monotonic()
            self._captured.wait()
            waited = time.monotonic() - t0
            self.stats["hook_wait_s"] += waited
            self._last_cost += waited

    def _finish(self, before: int | None = None) -> None:
        """Wait for the snapshots in flight numbered below `before` (all: None) and take what their
        exchanges agreed: K, or that snapshots stop. Every rank waits for the same ones at the same
        snapshot, so every rank applies the same K at the same step."""
        while self._inflight and (before is None or self._inflight[0][0] < before):
            _n, pending = self._inflight.popleft()
            try:
                failure, self.every = pending.result()
            except FAILURES as e:
                failure = f"{type(e).__name__}: {e}"
            if failure is not None and self.disabled is None:
                self.disabled = failure
                self._captured.set()
                self.log.emit("snapshot.disabled", reason=failure, path=str(self.directory))

    # --- the background thread -------------------------------------------------------------------
    def _capture(self, step: int, encoded: Any, error: str | None) -> Captured:
        """The copy thread (a large shard, from the live tensors) or the ring thread (a small one, from
        copies): this rank's shard file, sealed, or why not."""
        t0 = time.monotonic()
        buf = None
        try:
            if encoded is not None and encoded[0] == "raw":  # every tensor a private copy already
                encoded = ("encoded", *encode(encoded[1]))
            if encoded is not None:
                buf = pack(*encoded[1:], job=self.job, round_no=self.round, step=step, rank=self.comm.rank,
                           world_size=self.comm.world_size, copied=self._captured.set)
                self._small = encoded[2].data_length <= INLINE_BYTES
        except FAILURES as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            self._captured.set()
        self.stats["capture_s"] += time.monotonic() - t0
        return buf, error

    def _exchange(self, copy: Future[Captured] | tuple[int, Any, str | None],
                  proposal: int) -> tuple[str | None, int]:
        """The ring thread: the shard's copy (its future, or the arguments to make it here), then the
        snapshot's round on the ring (`shardring.exchange`)."""
        buf, error = copy.result() if isinstance(copy, Future) else self._capture(*copy)
        t0 = time.monotonic()
        assert self.ring is not None and self.directory is not None
        own, peer = (shard_path(self.directory, kind, self.comm.local_rank) for kind in (OWN, PEER))
        outcome = exchange(self.ring, own, peer, buf, proposal, error)
        self.stats["exchange_s"] += time.monotonic() - t0
        self.stats["bytes"] += len(buf) if buf is not None else 0
        return outcome

    # --- the end ---------------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        n, s = max(1, self.taken), self.stats
        return {"snapshots": self.taken, "every": self.every, "bytes": s["bytes"] // n,
                "blocked_ms": round(1e3 * s["blocked_s"] / n, 3),
                "hook_wait_ms": round(1e3 * s["hook_wait_s"] / n, 3),
                "capture_ms": round(1e3 * s["capture_s"] / n, 3),
                "exchange_ms": round(1e3 * s["exchange_s"] / n, 3), "disabled": self.disabled,
                "sharded": True}

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hooked = [], []

    def close(self) -> None:
        """Commit the snapshot in flight (every rank closes at the same step), release the hooks and the
        thread. The files stay: they belong to the agent's directory."""
        self._finish()
        self._unhook()
        self._copier.shutdown(wait=True)
        self._sender.shutdown(wait=True)
        if self.taken:
            self.log.emit("snapshot.stats", **self.report())


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
