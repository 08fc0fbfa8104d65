"""`every="auto"` at the edge: the prior from the environment, the job's own losses from a node-local
ledger, and the `checkpoint.interval` event (autointerval.py holds the decision).

Prior, in order: `$PETCTL_LOSS_RATE` (silent losses per node-hour, e.g. from a spot trace), else
`$PETCTL_SPOT_BAND` (a Spot Instance Advisor band; every interruption counted as possibly silent, since
notices are best effort), else the 10-15 % band. Observed: a worker that resumes from an in-memory
snapshot lost a node without a notice (a notice is answered by a durable save-now, so the store would
have been as new); the ledger (`auto-interval.json` in the agent's control directory) carries the count
and the node-hours seen across the worker restarts of a node. Without a control directory (no agent)
the count lives as long as the process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from petctl.core.eventlog import EventLog
from petctl.core.tracegen import band_rate
from petctl.elastic.autointerval import AutoInterval, LossModel

LEDGER = "auto-interval.json"
DEFAULT_BAND = "10-15%"


def prior_from_env(env: dict[str, str] | None = None) -> tuple[float, str]:
    """(silent losses per node-hour, where that came from). A bad value is a ValueError naming it."""
    env = dict(os.environ) if env is None else env
    if env.get("PETCTL_LOSS_RATE"):
        try:
            rate = float(env["PETCTL_LOSS_RATE"])
        except ValueError:
            raise ValueError(f"PETCTL_LOSS_RATE must be a number (losses per node-hour), "
                             f"not {env['PETCTL_LOSS_RATE']!r}") from None
        return max(rate, 0.0), "PETCTL_LOSS_RATE"
    band = env.get("PETCTL_SPOT_BAND") or DEFAULT_BAND
    return band_rate(band), f"band {band}"


class AutoWire:
    """One checkpointer's auto interval: measures, observes, decides, reports."""

    def __init__(self, nodes: int, tier: str, log: EventLog, control_dir: Path | None,
                 report: bool = True, clock=time.time) -> None:
        rate, source = prior_from_env()
        self.auto = AutoInterval(LossModel(nodes=max(1, nodes), tier=tier), rate, source)
        self.log = log
        self.report = report  # one rank speaks (the others keep the same interval silently)
        self.clock = clock
        self.path = control_dir / LEDGER if control_dir else None
        self.ledger = self._read()

    @property
    def seconds(self) -> float:
        """The interval now: the lower bound until the first save was measured."""
        return self.auto.choice.seconds if self.auto.choice else self.auto.lo

    def resumed(self, source: str, world_size: int) -> None:
        """A worker resumed (from `source`): count the node-hours since the last word, and a silent loss
        when it came from a snapshot."""
        self._advance(world_size)
        if source == "snapshot":
            self.ledger["losses"] = int(self.ledger.get("losses", 0)) + 1
        self._write()
        self._report(self.auto.observe(self.ledger["losses"], self.ledger["node_s"] / 3600.0))

    def saved(self, stall_s: float, upload_s: float, world_size: int) -> None:
        self._advance(world_size)
        self.auto.observe(int(self.ledger.get("losses", 0)), self.ledger["node_s"] / 3600.0)
        self._report(self.auto.saved(stall_s, upload_s))

    def _advance(self, world_size: int) -> None:
        now = self.clock()
        last = float(self.ledger.get("last", now))
        self.ledger["node_s"] = float(self.ledger.get("node_s", 0.0)) + max(0.0, now - last) * int(
            self.ledger.get("world", world_size))
        self.ledger["last"], self.ledger["world"] = now, world_size
        self.ledger.setdefault("losses", 0)

    def _report(self, choice) -> None:
        if choice is not None and self.report:
            self.log.emit("checkpoint.interval", **self.auto.fields())

    def _read(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            return dict(json.loads(self.path.read_text()))
        except (OSError, ValueError) as e:  # a torn ledger costs the history, not the job: say so once
            self.log.emit("checkpoint.interval_ledger_unreadable", path=str(self.path), error=repr(e))
            return {}

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.ledger))
            os.replace(tmp, self.path)
        except OSError as e:
            self.log.emit("checkpoint.interval_ledger_unwritable", path=str(self.path), error=repr(e))
