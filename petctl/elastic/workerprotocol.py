"""The worker side of the agent protocol: the save-now flag, the commit fence, the start-up time.

Worker side of the save-now protocol: "should every rank checkpoint now and exit?" at a step boundary.

The agent of every node writes `<PETCTL_CONTROL_DIR>/save_now` when the running round carries a save-now
request (`petctl.io.controlfiles`): a node's spot or ASG notice, a graceful leave, or a planned admission of
a waiting node. The nodes learn of it at slightly different times, so each rank reads its local flag and
the ranks all-reduce it (MAX): every rank gets the same answer at the same step, and so all ranks save the
same step. After the save each worker writes `saved.<LOCAL_RANK>` and exits 0.

The same all-reduce carries a second question: "has any node's agent asked for a checkpoint now?"
(`<control>/checkpoint`, written on a rebalance recommendation). Every rank learns the answer at the same
step, so the checkpointer saves that step (collectively where the save is collective) and training goes
on. A request is answered once: the worker records its sequence number (`checkpointed.<LOCAL_RANK>`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from petctl.elastic.dist import Comm
from petctl.io import controlfiles
from petctl.io.eventlog import EventLog


class Verdict(NamedTuple):
    """What the ranks agreed on at one check step."""

    save_now: bool  # a save-now request is pending: save this step and exit
    also: bool  # the caller's extra flag, true on some rank
    checkpoint: bool  # some node's agent asked for a checkpoint now: save this step, train on


@dataclass
class SaveNowMonitor:
    """Checks the save-now flag (and a checkpoint request) every `check_every` steps (0 disables); sticky
    once the save-now has fired.

    `check_every` must be the same on every rank and steps must advance in lockstep (they do under
    DDP), since the check is a collective call.
    """

    comm: Comm = field(default_factory=Comm)
    control_dir: Path | None = field(default_factory=controlfiles.control_dir_from_env)
    check_every: int = 1
    fired_at: int | None = None
    answered: int | None = None  # the newest checkpoint request this local rank answered (read lazily)
    asked: int = 0  # the request seen pending here at the last check (0: none)
    _request_stat: tuple[int, int] | None = field(default=None, repr=False)
    _request: tuple[int, str] = field(default=(0, ""), repr=False)

    def local_flag(self) -> bool:
        return controlfiles.save_now_pending(self.control_dir)

    def should_checkpoint(self, step: int) -> bool:
        """True on every rank at the same step once any node's agent has raised the flag."""
        return self.poll(step)[0]

    def is_check_step(self, step: int) -> bool:
        """Whether `step` runs the check's collective (every `check_every` steps, until it fires)."""
        return self.fired_at is None and self.check_every > 0 and step % self.check_every == 0

    def poll(self, step: int, also: bool = False) -> tuple[bool, bool]:
        """(save-now pending, `also` true on any rank): the save-now question, plus one more flag
        the ranks must agree on, in the same all-reduce. Off the check steps: (False, False), or
        (True, False) once fired."""
        verdict = self.check(step, also)
        return verdict.save_now, verdict.also

    def check(self, step: int, also: bool = False) -> Verdict:
        """`poll`, plus whether a checkpoint was requested on any node: all three in one all-reduce."""
        if self.fired_at is not None:
            return Verdict(True, False, False)
        if not self.is_check_step(step):
            return Verdict(False, False, False)
        self.asked = self.pending_request()
        pending, also, requested = self.comm.any_true_each(self.local_flag(), also, self.asked > 0)
        if pending:
            self.fired_at = step
        return Verdict(pending, also, requested)

    def request(self) -> tuple[int, str]:
        """(seq, reason) of this node's newest checkpoint request; re-read only when the file changed
        (a stat per check step, like the save-now flag)."""
        if self.control_dir is None:
            return 0, ""
        try:
            st = os.stat(controlfiles.checkpoint_request_path(self.control_dir))
        except OSError:
            return 0, ""
        key = (st.st_ino, st.st_mtime_ns)  # written by rename: a new request is a new inode
        if key != self._request_stat:
            self._request_stat, self._request = key, controlfiles.read_checkpoint_request(self.control_dir)
        return self._request

    def pending_request(self) -> int:
        """The seq of this node's request when this local rank has not answered it yet, else 0."""
        if self.answered is None:
            self.answered = controlfiles.answered_checkpoint(self.control_dir, self.comm.local_rank)
        seq = self.request()[0]
        return seq if seq > self.answered else 0

    def report_checkpointed(self, step: int) -> Path | None:
        """The request seen at the last check is answered by the checkpoint of `step` (handed to a save,
        or already saved): recorded, so neither this worker nor a later round's answers it again. None
        when no request was pending here. Raises OSError when the control dir is unwritable."""
        if not self.asked or self.control_dir is None:
            return None
        seq, self.asked = self.asked, 0
        self.answered = seq
        return controlfiles.write_checkpointed(self.control_dir, self.comm.local_rank, seq, step)

    def deadline(self) -> float | None:
        """The agent's deadline for the save, when this node has the flag (for events and logs)."""
        if self.control_dir is None:
            return None
        data = controlfiles.read_save_now(self.control_dir)
        value = (data or {}).get("deadline")
        return float(value) if isinstance(value, (int, float)) else None

    def announce(self) -> Path | None:
        """Mark this worker as speaking the protocol, so the agent flags it instead of SIGTERMing it."""
        if self.control_dir is None:
            return None
        try:
            return controlfiles.mark_elastic(self.control_dir, self.comm.local_rank)
        except OSError:  # an unwritable control dir only costs the graceful path, never the training
            return None

    def report_saved(self, step: int) -> Path | None:
        """Tell the agent this worker's save-now save of `step` is done (it exits next)."""
        if self.control_dir is None:
            return None
        return controlfiles.write_saved(self.control_dir, self.comm.local_rank, step)


# --- the commit fence ---------------------------------------------------------------------------------------
# Worker side of fencing: no checkpoint is committed while the agent says this node may be cut off.
#
# An agent that lost etcd while its workers stalled cannot know whether the others re-formed without it.
# It writes `<PETCTL_CONTROL_DIR>/fenced` (`petctl.io.controlfiles`); from then on a save of this node's
# workers must not become visible to a loader: the survivors may already be training on from an older
# checkpoint, and a manifest from the cut-off node would put its stale lineage in front of theirs.
#
# The checkpointers ask `CommitFence.blocks(step)` twice per save: before any byte is uploaded (a fenced
# node writes nothing) and right before the manifest, the commit itself (a background upload that started
# before the fence and ends after it is dropped there). A stat each time, no parsing unless fenced.
#
# One `checkpoint.fenced` event when a fence is first seen, one `checkpoint.unfenced` (with how many saves
# were skipped) at the first save allowed after it was lifted; `skipped` counts every skipped commit.


class CommitFence:
    """Whether a save may commit now; thread-safe (the background uploader asks it too)."""

    def __init__(self, control_dir: Path | None, log: EventLog, url: str) -> None:
        self.control_dir = control_dir
        self.log = log
        self.url = url
        self.skipped = 0  # commits skipped because of a fence, over this checkpointer's life
        self._lock = threading.Lock()
        self._since: float | None = None  # when the current fence was first seen; None: not fenced
        self._skipped_in_fence = 0

    def blocks(self, step: int, stage: str) -> bool:
        """True (and the skip counted, reported once per fence) when the save of `step` must not go on.

        `stage` says where the save was stopped ("upload" before any byte, "commit" before the manifest).
        """
        fenced = controlfiles.fenced(self.control_dir)
        with self._lock:
            if fenced:
                self.skipped += 1
                self._skipped_in_fence += 1
                if self._since is None:
                    self._since = time.time()
                    self.log.emit("checkpoint.fenced", step=step, stage=stage, url=self.url,
                                  **_fence_info(self.control_dir))
                return True
            if self._since is not None:
                self.log.emit("checkpoint.unfenced", step=step, skipped=self._skipped_in_fence,
                              seconds=round(time.time() - self._since, 3), url=self.url)
                self._since, self._skipped_in_fence = None, 0
            return False


def _fence_info(control_dir: Path | None) -> dict[str, Any]:
    """The agent's note in the fence file (round, reason) for the event; {} when it cannot be read."""
    if control_dir is None:
        return {}
    try:
        data = json.loads(controlfiles.fence_path(control_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # removed or half there: the event goes out without the details
        return {}
    if not isinstance(data, dict):
        return {}
    return {"fence_round": data.get("round"), "reason": data.get("reason")}


# --- the worker's start-up time -----------------------------------------------------------------------------
# When this worker started, for the recovery timeline `Checkpointer.resume` reports (`checkpoint.resumed`).
#
# A warm worker (the agent's warm_worker module) was started long before its round: it writes the moment it
# got its orders into its environment (`PETCTL_WORKER_ORDER_TS`, the agent's side of this contract). A worker
# started cold (petctl without warm workers, torchrun) has no such variable: its process start time, from
# /proc, is the same moment. Stdlib only, cheap: read once per `resume`.


ENV_ORDER_TS = "PETCTL_WORKER_ORDER_TS"  # written by the agent's warm worker (a test checks both agree)


def process_start_time(pid: int | None = None) -> float | None:
    """Unix time process `pid` (default: this one) started, from /proc; None where that is unreadable."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def worker_started_at(environ: dict[str, str] | None = None) -> float | None:
    """When this worker began running the script: the warm worker's order time, else the process start."""
    value = (os.environ if environ is None else environ).get(ENV_ORDER_TS, "")
    try:
        return float(value) if value else process_start_time()
    except ValueError:
        return process_start_time()
