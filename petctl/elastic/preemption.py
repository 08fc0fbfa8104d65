"""Worker side of the preemption protocol: "should every rank checkpoint now?" at a step boundary.

The agent of every node writes `<PETCTL_CONTROL_DIR>/preempt` when any node of the job has a notice
(`petctl.core.controlfiles`). A node learns of it at slightly different times, so each rank reads its
local flag and the ranks all-reduce it (MAX): every rank gets the same answer at the same step, and so
all ranks save the same step. After the save each worker writes `saved.<LOCAL_RANK>` and exits 0.

The same all-reduce carries a second question: "has any node's agent asked for a checkpoint now?"
(`<control>/checkpoint`, written on a rebalance recommendation). Every rank learns the answer at the same
step, so the checkpointer saves that step (collectively where the save is collective) and training goes
on. A request is answered once: the worker records its sequence number (`checkpointed.<LOCAL_RANK>`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from petctl.core import controlfiles
from petctl.elastic.dist import Comm


class Verdict(NamedTuple):
    """What the ranks agreed on at one check step."""

    preempt: bool  # a preemption is pending: save this step and exit
    also: bool  # the caller's extra flag, true on some rank
    checkpoint: bool  # some node's agent asked for a checkpoint now: save this step, train on


@dataclass
class PreemptionMonitor:
    """Checks the control flag every `check_every` steps (0 disables); sticky once it has fired.

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
        return controlfiles.preempt_pending(self.control_dir)

    def should_checkpoint(self, step: int) -> bool:
        """True on every rank at the same step once any node's agent has raised the flag."""
        return self.poll(step)[0]

    def is_check_step(self, step: int) -> bool:
        """Whether `step` runs the check's collective (every `check_every` steps, until it fires)."""
        return self.fired_at is None and self.check_every > 0 and step % self.check_every == 0

    def poll(self, step: int, also: bool = False) -> tuple[bool, bool]:
        """(preemption pending, `also` true on any rank): the preemption question, plus one more flag
        the ranks must agree on, in the same all-reduce. Off the check steps: (False, False), or
        (True, False) once fired."""
        verdict = self.check(step, also)
        return verdict.preempt, verdict.also

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
        (a stat per check step, like the preemption flag)."""
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
        data = controlfiles.read_preempt(self.control_dir)
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
        """Tell the agent this worker's preemption save of `step` is done (it exits next)."""
        if self.control_dir is None:
            return None
        return controlfiles.write_saved(self.control_dir, self.comm.local_rank, step)
