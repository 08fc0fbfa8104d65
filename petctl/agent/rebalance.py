"""A rebalance recommendation: the agent asks its workers for a checkpoint now.

A recommendation (imds.py) says this instance is at elevated risk of interruption. It is not a notice:
nothing is announced in the round and training goes on. The agent writes `<control>/checkpoint`
(io/controlfiles.py) with the next sequence number; every rank of the job learns of it in the
save-now check's all-reduce and saves the same step at once (elastic/workerprotocol.py). Whatever comes
next (the two-minute notice, a late one, none at all before the ASG's Capacity Rebalancing scales this
instance in) then starts from a checkpoint taken when the risk was announced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from petctl.io import controlfiles
from petctl.io.eventlog import EventLog

REASON = "rebalance"


class RebalanceResponder:
    """The watcher's `on_rebalance` callback: one checkpoint request per recommendation."""

    def __init__(self, control_dir: Path, events: EventLog) -> None:
        self.control_dir = Path(control_dir)
        self.events = events
        self.requests = 0  # written so far (for tests and diagnostics)

    def __call__(self, recommendation: Any) -> None:
        """Write the request and say so (`checkpoint.requested`); a control dir that cannot be written
        is reported (`checkpoint.request_failed`): the workers then only save at their usual times."""
        notice_time = getattr(recommendation, "notice_time", None)
        try:
            seq = controlfiles.request_checkpoint(self.control_dir, REASON)
        except OSError as e:
            self.events.emit("checkpoint.request_failed", reason=REASON, error=repr(e))
            return
        self.requests += 1
        self.events.emit("checkpoint.requested", seq=seq, reason=REASON, notice_time=notice_time)
