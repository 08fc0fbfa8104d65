"""Worker side of the preemption protocol: "should every rank checkpoint now?" at a step boundary.

The agent of every node writes `<PETCTL_CONTROL_DIR>/preempt` when any node of the job has a notice
(`petctl.core.controlfiles`). A node learns of it at slightly different times, so each rank reads its
local flag and the ranks all-reduce it (MAX): every rank gets the same answer at the same step, and so
all ranks save the same step. After the save each worker writes `saved.<LOCAL_RANK>` and exits 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from petctl.core import controlfiles
from petctl.elastic.dist import Comm


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
        if self.fired_at is not None:
            return True, False
        if not self.is_check_step(step):
            return False, False
        pending, also = self.comm.any_true_each(self.local_flag(), also)
        if pending:
            self.fired_at = step
        return pending, also

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
