"""Small torch.distributed helpers that also work in a single process (dist not initialised).

Checkpoint coordination is control traffic (a flag, a few hundred MB once at start), so it runs on a
gloo group over CPU tensors even when training uses NCCL: no GPU memory, no stream syncs, and the same
code on CPU-only test machines. The gloo group is created once per `Comm` (a collective call, so every
rank must create its `Comm` at the same point: `Checkpointer.__init__`).
"""

from __future__ import annotations

import atexit
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Why a finished collective can still crash the process at exit (seen as `terminate called without an
# active exception` from a worker that had just made its save-now save; confirmed in core dumps):
# gloo runs each collective on a worker thread ("pt_gloo_runloop"), which marks the work complete and only
# then, a moment later, destroys its work object and the tensors in it. If Python has dropped its own
# references by then, torch has handed the tensors' Python objects to C++, so that last release takes the
# GIL. On a loaded machine the thread can be descheduled in that moment for longer than the main thread
# needs to reach interpreter finalization; taking the GIL then makes Python end the thread (pthread_exit),
# whose forced unwind through a noexcept destructor calls std::terminate. Two defences:
#   - petctl's own collectives keep their tensors until gloo has let go of them (`_settle`), so the last
#     release is always Python's, on the calling thread;
#   - once any distributed Comm exists, an atexit hook (run before finalization starts) waits, bounded,
#     until no gloo worker thread is runnable, which covers collectives inside torch (FSDP, DCP) too.
SETTLE_TIMEOUT = 5.0  # a release takes microseconds; the bound only guards against a stuck thread
QUIESCE_TIMEOUT = 2.0
GLOO_THREAD_NAME = "pt_gloo_runloop"


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass
class Comm:
    """Rank facts and the CPU collectives petctl.elastic needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None  # the gloo process group (None: the default group, or no dist at all)
    distributed: bool = False
    created_at: float = field(default_factory=time.time)  # for the recovery timeline (checkpoint.resumed)
    _owns_group: bool = field(default=False, repr=False)

    @classmethod
    def create(cls) -> Comm:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not is_distributed():
            # Without dist every process acts alone; RANK still decides who writes, so torchrun scripts
            # that never call init_process_group don't have every rank uploading the same bytes.
            return cls(rank=int(os.environ.get("RANK", "0")), world_size=1, local_rank=local_rank)
        group = None
        owns = False
        if dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
            owns = True
        # Registered once per process (unregister first: several checkpointers may be created).
        atexit.unregister(quiesce_gloo_threads)
        atexit.register(quiesce_gloo_threads)
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                   group=group, distributed=True, _owns_group=owns)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def any_true(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank (all-reduce MAX of one CPU int)."""
        return self.any_true_each(flag)[0]

    def any_true_each(self, *flags: bool) -> tuple[bool, ...]:
        """`any_true` of several flags in one all-reduce (MAX of a few CPU ints): several questions
        agreed on for the price of one."""
        if not self.distributed:
            return tuple(bool(f) for f in flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        self._collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group), t)
        return tuple(bool(v) for v in t.tolist())

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` from rank `src` on every rank (pickled, as `broadcast_object_list` does).

        Two broadcasts on tensors this method owns until gloo has released them (see the module notes):
        the payload's size, then the payload itself, written straight into a bytearray on receivers.
        """
        if not self.distributed:
            return obj
        if self.rank == src:
            payload = bytearray(pickle.dumps(obj))
            size = torch.tensor([len(payload)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._collective(lambda: dist.broadcast(size, src=src, group=self.group), size)
        if self.rank != src:
            payload = bytearray(int(size.item()))
        data = torch.frombuffer(payload, dtype=torch.uint8)
        self._collective(lambda: dist.broadcast(data, src=src, group=self.group), data)
        return obj if self.rank == src else pickle.loads(payload)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (pickled; for small objects: offers, flags).
        Two all-gathers on tensors this method owns until gloo has released them: the sizes, then the
        payloads padded to the longest."""
        if not self.distributed:
            return [obj]
        payload = pickle.dumps(obj)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._collective(lambda: dist.all_gather(sizes, size, group=self.group), size, *sizes)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._collective(lambda: dist.all_gather(outs, mine, group=self.group), mine, *outs)
        return [pickle.loads(out[:int(n.item())].numpy().tobytes())
                for out, n in zip(outs, sizes, strict=True)]

    def broadcast_buffer(self, buffer: bytearray | None, size: int, src: int = 0) -> bytearray:
        """`buffer` (`size` bytes, given on rank `src`) on every rank, received straight into a new
        bytearray without pickling (a snapshot's payload: hundreds of MB)."""
        if not self.distributed:
            assert buffer is not None
            return buffer
        if self.rank != src:
            buffer = bytearray(size)
        assert buffer is not None and len(buffer) == size
        if size:
            data = torch.frombuffer(buffer, dtype=torch.uint8)
            self._collective(lambda: dist.broadcast(data, src=src, group=self.group), data)
        return buffer

    @staticmethod
    def _collective(run: Callable[[], Any], *tensors: torch.Tensor) -> None:
        run()
        _settle(tensors)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def close(self) -> None:
        if self._owns_group and self.group is not None and is_distributed():
            dist.destroy_process_group(self.group)
        self.group = None
        self._owns_group = False


def _settle(tensors: tuple[torch.Tensor, ...], timeout: float = SETTLE_TIMEOUT) -> bool:
    """Wait until nothing but the caller holds `tensors` (gloo's worker thread has destroyed the work that
    held them); bounded. Returns False on timeout, or where torch has no `Tensor._use_count`."""
    deadline = time.monotonic() + timeout
    polls = 0
    for t in tensors:
        use_count = getattr(t, "_use_count", None)
        if use_count is None:
            return False
        while use_count() > 1:
            if time.monotonic() > deadline:
                return False
            # Usually a few microseconds: yield (and the GIL) first; back off only if it takes longer.
            time.sleep(0 if polls < 200 else 0.0002)
            polls += 1
    return True


def gloo_threads_runnable(task_dir: Path = Path("/proc/self/task")) -> int:
    """How many of this process's gloo worker threads are runnable (not asleep waiting for work, the
    network or the GIL). Linux only: 0 where /proc has no task list."""
    busy = 0
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            if (task / "comm").read_text().strip() != GLOO_THREAD_NAME:
                continue
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread is gone
        if state not in ("S", "I"):
            busy += 1
    return busy


def quiesce_gloo_threads(timeout: float = QUIESCE_TIMEOUT, idle_polls: int = 3) -> bool:
    """atexit (interpreter still alive): wait until no gloo worker thread is runnable for `idle_polls`
    polls in a row, so a finished collective's release takes the GIL now rather than during
    finalization. Sleeping releases the GIL, so a thread waiting for it runs. Bounded by `timeout`;
    returns whether the threads went idle."""
    deadline = time.monotonic() + timeout
    idle = 0
    while idle < idle_polls:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
        idle = 0 if gloo_threads_runnable() else idle + 1
    return True
