"""The sharded tier (`ShardSnapshotTier`): what a rank captures of its sharded state, the ring its shard
travels on to the next node, and the tier that writes, exchanges and resumes them.

The in-memory snapshot tier of `ShardedCheckpointer`: one node lost costs at most one step, also when
every rank holds only a shard of the state.

Every K steps each rank keeps its own shard in its node's memory (the agent's tmpfs directory,
$PETCTL_SNAPSHOT_DIR) and sends a copy to the same local rank on the next node in rank order (rank +
local world size, mod world), which keeps it as its peer shard: a node lost takes one shard and one
peer copy with it, and the shard it lost is still held by the next node. Per rank: one own shard and one
peer shard, the newest; while the ranks commit a new save, the one before it too.

How a snapshot runs, so the training thread pays little:
- training thread (`take`): the state dict (every rank, the same step: FSDP's `get_state_dict` may run
  collectives), clones of what the next forward could change (buffers, extras), each DTensor as its
  local tensor and offset, a pickled skeleton (`codec`), and a hand-off;
- background thread: the tensors' bytes copied into the shard file's buffer (`codec.pack`) straight
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

import copy
import datetime
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from petctl.elastic.background import yield_cpu_to_training
from petctl.elastic.snapshots import ENV_JOB, ENV_ROUND, SnapshotOptions, resolve
from petctl.elastic.snapshots.codec import (
    DTENSOR_KEY,
    OWN,
    OWN_BEFORE,
    PEER,
    PEER_BEFORE,
    SHARD_KINDS,
    TENSOR_KEY,
    commit,
    encode,
    pack,
    shard_path,
    stage,
)
from petctl.elastic.snapshots.resume import ShardReader, resume_sharded
from petctl.elastic.snapshots.writer import Cadence
from petctl.elastic.state import ShardedState, rebuild_dict
from petctl.io.eventlog import EventLog

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
        # lags behind the steps (a starved thread on a loaded machine) holds the next optimizer step.
        self._sender = ThreadPoolExecutor(1, "petctl-ring")
        self._inflight: deque[tuple[int, Future[tuple[str | None, int]]]] = deque()
        # a change of the agreed K, announced once the snapshot it applies after is whole on two nodes:
        # (that snapshot's round, its step, the new K, the old one)
        self._changes: list[tuple[Future[tuple[str | None, int]], int, int, int]] = []
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
        was = self.every
        # all but the previous one, whose round the optimizer's pre-hook waits for (also where K was
        # agreed); with no optimizer to hook, all of them, here
        self._finish(before=self.taken - 1 if self._hooks else self.taken)
        self._announce()
        if self.disabled is not None:
            return False
        if self.taken:
            changed = self.cadence.record(self._last_cost)
            if changed is not None:
                self.log.emit("snapshot.proposed", step=step, proposed=changed[0], was=changed[1],
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
        self._hook(app_state)
        if encoded is not None and encoded[0] == "encoded":  # a copy thread's: hold the next step for it
            self._captured.clear()
            copy: Any = self._copier.submit(self._capture, step, encoded, error)
        else:
            copy = (step, encoded, error)  # made by the ring thread itself: one hand-off
        pending = self._sender.submit(self._exchange, copy, self.cadence.every)
        self._inflight.append((self.taken, pending))
        if self.every != was:  # the next snapshot comes `every` steps after this one
            self._changes.append((pending, step, self.every, was))
        self.due = self.every
        self.taken += 1
        self._last_cost = waited + time.thread_time() - cpu0
        self.stats["blocked_s"] += time.monotonic() - t0
        return True

    def _hook(self, app_state: dict[str, Any]) -> None:
        optimizers = find_optimizers(app_state)
        if [id(o) for o in optimizers] == [id(o) for o in self._hooked]:
            return
        self._unhook()
        self._hooked = optimizers
        self._hooks = [o.register_step_pre_hook(self._before_optimizer_step) for o in optimizers]

    def _before_optimizer_step(self, *_: Any) -> None:
        """Before a step changes the parameters: the last snapshot's copy is done (the step would change
        what it copies), and so is every snapshot's round on the ring. So once a step is done, the
        snapshot before it is whole on two nodes, and a node lost costs at most K steps, also when the
        ring thread lags on a loaded machine. Training then waits instead, and the cadence counts the
        wait as the snapshot's cost."""
        copying = self.overlap and not self._captured.is_set()  # without overlap it copies private tensors
        rounds = [pending for _n, pending in self._inflight if not pending.done()]
        if copying or rounds:
            t0 = time.monotonic()
            if copying:
                self._captured.wait()
            wait_futures(rounds)
            waited = time.monotonic() - t0
            self.stats["hook_wait_s"] += waited
            self._last_cost += waited
        self._announce()

    def _announce(self) -> None:
        """`snapshot.every` for each change of the agreed K whose snapshot is now whole on two nodes: from
        then on a node lost costs at most the new K steps. Said earlier, a lowering would promise too
        much: the snapshot it follows may still be in flight, and a kill then costs the old K. A round
        that failed announces nothing (the tier is off, or the job re-forms)."""
        while self._changes and self._changes[0][0].done():
            pending, step, every, was = self._changes.pop(0)
            if pending.exception() is None and pending.result()[0] is None:
                self.log.emit("snapshot.every", step=step, every=every, was=was)

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
        snapshot's round on the ring (`ring.exchange`)."""
        buf, error = copy.result() if isinstance(copy, Future) else self._capture(*copy)
        t0 = time.monotonic()
        assert self.ring is not None and self.directory is not None
        paths = {kind: shard_path(self.directory, kind, self.comm.local_rank) for kind in SHARD_KINDS}
        outcome = exchange(self.ring, paths, buf, proposal, error)
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
        self._announce()
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


# --- what a sharded snapshot captures -----------------------------------------------------------------------
# What a sharded snapshot captures, taken on the training thread: the state dict, with the tensors that
# `optimizer.step()` alone changes left live and everything else copied.
#
# Why: the capture runs on a background thread while the next step's forward and backward run. FSDP's
# sharded parameters and the optimizer's state change only inside `optimizer.step()` (which a pre-hook holds
# until the capture is done), so they are read in place; a module buffer (BatchNorm's running stats), a
# user's tensor or extra could change in the next forward, so it is cloned now (small, as a rule).


_LEAVES = (int, float, str, bool, bytes, type(None))


def find_optimizers(app_state: dict[str, Any]) -> list[Any]:
    """The optimizers in an app state: `ShardedState.optimizer`s and optimizers given directly."""
    import torch

    found = []
    for value in app_state.values():
        opt = value if isinstance(value, torch.optim.Optimizer) else getattr(value, "optimizer", None)
        if isinstance(opt, torch.optim.Optimizer) and all(opt is not o for o in found):
            found.append(opt)
    return found


def _ptr(tensor: Any) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
    return local.data_ptr() if local.numel() else 0


def live_pointers(optimizers: list[Any]) -> set[int]:
    """Storage of what only `optimizer.step()` writes: the parameters and the optimizer's state."""
    import torch

    live = set()
    for opt in optimizers:
        live.update(_ptr(p) for group in opt.param_groups for p in group["params"])
        live.update(_ptr(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    live.discard(0)
    return live


class StateDicts:
    """`ShardedState.state_dict()` at every snapshot without `get_state_dict`'s per-call cost (option
    checks over every module, about 0.2 ms of the 0.5 ms a small model's snapshot costs the training
    thread): the model's own `state_dict()` and the optimizer's, its parameter numbers renamed to the
    names `get_state_dict` gives them. The names are learnt from one `get_state_dict` call and used only
    when the result then matched it key for key; otherwise every call is `get_state_dict`'s."""

    def __init__(self) -> None:
        self.names: dict[int, list[str] | None] = {}  # id(ShardedState) -> parameter number -> name
        self._live: tuple[Any, set[int]] | None = None

    def live(self, app_state: dict[str, Any]) -> set[int]:
        """`live_pointers` of the app state's optimizers, again only when their state may have changed
        (other optimizers, a new state dict: `load_state_dict`, or more parameters with state: the state
        is made lazily)."""
        optimizers = find_optimizers(app_state)
        key = tuple((id(o), id(o.state), len(o.state)) for o in optimizers)
        if self._live is None or self._live[0] != key:
            self._live = (key, live_pointers(optimizers))
        return self._live[1]

    def of(self, value: Any) -> Any:
        """`value.state_dict()`, or its equal, cheaper (see the class)."""
        names = self.names.get(id(value))
        if names is None:
            full = value.state_dict()
            if id(value) not in self.names and _plain_sharded_state(value):
                learnt = [n for group in full["optim"]["param_groups"] for n in group["params"]]
                self.names[id(value)] = learnt if _same_keys(self._quick(value, learnt), full) else None
            return full
        return self._quick(value, names)

    @staticmethod
    def _quick(value: Any, names: list[str]) -> dict[str, Any]:
        osd = value.optimizer.state_dict()
        state = {names[i]: v for i, v in osd["state"].items()}
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
        return {"model": value.model.state_dict(), "optim": {"state": state, "param_groups": groups},
                "extra": dict(value.extra)}


def _plain_sharded_state(value: Any) -> bool:
    return type(value) is ShardedState and value.optimizer is not None


def _same_keys(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_keys(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_keys(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and (not isinstance(a, str) or a == b)


def detach_for_capture(app_state: dict[str, Any], overlap: bool = True,
                       offsets: dict[Any, list[int]] | None = None,
                       state_dicts: StateDicts | None = None) -> tuple[Any, list[Any]]:
    """(skeleton, tensors) of `app_state`: each `Stateful` asked for its `state_dict()` now (on every
    rank at the same step: FSDP's may run collectives), every tensor moved to `tensors` and replaced by
    `{codec.TENSOR_KEY: i}`, each DTensor by its local piece and where that sits
    (`{codec.DTENSOR_KEY: [piece, global shape, global offset]}`). A tensor stays live when only
    `optimizer.step()` changes it (`overlap`) and is copied otherwise. `offsets` caches where a DTensor's
    piece sits (the same for the life of a world). One walk: it runs on the training thread at every
    snapshot. Raises what `state_dict()` raises."""
    from torch.distributed.checkpoint.stateful import Stateful

    live = (state_dicts.live(app_state) if state_dicts is not None else
            live_pointers(find_optimizers(app_state))) if overlap else set()
    tensors: list[Any] = []
    walk = _Walk(live, {} if offsets is None else offsets, tensors)
    of = state_dicts.of if state_dicts is not None else (lambda v: v.state_dict())
    skeleton = {k: walk(of(v) if isinstance(v, Stateful) else v) for k, v in app_state.items()}
    return skeleton, tensors


class _Walk:
    def __init__(self, live: set[int], offsets: dict[Any, list[int]], tensors: list[Any]) -> None:
        import torch

        self.live, self.offsets, self.tensors, self.tensor_type = live, offsets, tensors, torch.Tensor

    def __call__(self, obj: Any) -> Any:
        if type(obj) in _LEAVES:
            return obj
        if isinstance(obj, self.tensor_type):
            local = getattr(obj, "_local_tensor", None)  # a DTensor: its piece on this rank
            plain = (obj if local is None else local).detach()
            self.tensors.append(plain if _ptr(plain) in self.live else plain.clone())
            marker = {TENSOR_KEY: len(self.tensors) - 1}
            if local is None:
                return marker
            return {DTENSOR_KEY: [marker, list(obj.shape), _offset(obj, self.offsets)]}
        if isinstance(obj, dict):
            return rebuild_dict(obj, [(k, self(v)) for k, v in obj.items()])  # pickled at once: copied
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            items = [self(v) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)


def _offset(dtensor: Any, offsets: dict[Any, list[int]]) -> list[int]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    key = (tuple(dtensor.shape), id(dtensor.device_mesh), tuple(dtensor.placements))
    found = offsets.get(key)
    if found is None:
        _shape, offset = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh,
                                                               dtensor.placements)
        found = offsets[key] = list(offset)
    return found


# --- the ring -----------------------------------------------------------------------------------------------
# The ring sharded snapshots travel on: rank r sends its shard to rank r + local world size (the same
# local rank on the next node, mod world) and keeps the one rank r - local world size sends, on a gloo group
# of its own (made collectively with the checkpointer: its operations run on the snapshot thread, and must
# never interleave with the training thread's on the default group). Every rank calls the same operations
# in the same order (the snapshot steps are agreed), so the group never deadlocks on a live job.


TIMEOUT = datetime.timedelta(seconds=120)  # a neighbour gone: the job re-forms long before this


@dataclass
class ShardRing:
    rank: int
    next: int
    prev: int
    group: Any = None  # None: a single process (no peer, nothing to agree with)

    @classmethod
    def create(cls, comm: Any, local_world: int) -> ShardRing:
        """Collective when `comm` is distributed (every rank makes it, at the same point)."""
        world = comm.world_size
        group = dist.new_group(backend="gloo", timeout=TIMEOUT) if comm.distributed else None
        return cls(comm.rank, (comm.rank + local_world) % world, (comm.rank - local_world) % world, group)

    @property
    def has_peer(self) -> bool:
        """Another node to keep a copy: false on a one-node job, whose loss no copy in it could cover."""
        return self.group is not None and self.next != self.rank

    def all_max(self, *values: int) -> tuple[int, ...]:
        """The maximum of each value over every rank (one all-reduce)."""
        if self.group is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(v) for v in t.tolist())

    def swap(self, buf: bytearray) -> bytearray:
        """Send `buf` to the next node's rank; what the previous node's rank sent (its size first)."""
        size, theirs = torch.tensor([len(buf)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        self._pair(size, theirs)
        received = bytearray(int(theirs.item()))
        self._pair(torch.frombuffer(buf, dtype=torch.uint8), torch.frombuffer(received, dtype=torch.uint8))
        return received

    def _pair(self, out: torch.Tensor, into: torch.Tensor) -> None:
        works = [dist.isend(out, self.next, group=self.group), dist.irecv(into, self.prev, group=self.group)]
        for work in works:
            work.wait()


def exchange(ring: ShardRing, paths: dict[str, Path], buf: bytearray | None, proposal: int,
             error: str | None) -> tuple[str | None, int]:
    """One snapshot's round on the ring, the same operations on every rank: agree on the next K (the
    largest proposed) and on every capture having worked; swap shard files with the neighbours; stage
    both; agree every rank staged both; rename both into place, each keeping the save it replaces
    (`paths`: a file per kind in codec.SHARD_KINDS); agree every rank committed; only then drop the
    kept ones. (None, agreed K), or (why snapshots stop here, K). Raises what gloo raises when a
    neighbour is gone (the job re-forms then).

    Why keep the save before: an all-reduce that ends on one rank has not ended on every rank. A node
    killed during the commit's agreement can leave one survivor with the new save and the next with the
    old one only; with the save before kept until every rank committed, both still hold the old save
    whole, on two nodes, and the loss costs one save's steps (tests/elastic/test_sharded_snapshots.py)."""
    own, peer = paths[OWN], paths[PEER]
    every, failed = ring.all_max(proposal, int(buf is None))
    if failed:
        return error or "a capture failed on another rank", every
    assert buf is not None
    staged: list[tuple[Path, Path]] = []
    try:
        staged.append((stage(own, buf), own))
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    if ring.has_peer:
        received = ring.swap(buf)  # every rank swaps, staged or not: the ring stays in step
        try:
            staged.append((stage(peer, received), peer))
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    if ring.all_max(int(error is not None))[0]:  # commit only when every rank staged both
        for tmp, _path in staged:
            tmp.unlink(missing_ok=True)
        return error or "staging a shard failed on another rank", every
    before = {own: paths[OWN_BEFORE], peer: paths[PEER_BEFORE]}
    for tmp, path in staged:
        commit(tmp, path, keep=before[path])
    ring.all_max(0)  # every rank committed: no rank needs a save before the new one
    for _tmp, path in staged:
        before[path].unlink(missing_ok=True)
    return None, every
