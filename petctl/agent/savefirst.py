"""Save first: one node's part in the round's save-now requests, whoever asked for them.

Three things ask every member's workers to save the same step and exit before the round re-forms: a
preemption notice of this instance (notices.py), a graceful leave of this node, and this node admitting a
waiting node (roundjudge.py decides the last two). `save_done` is the one test of "the save has finished",
for a notice's save and a planned change's.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from petctl.agent.decisions import RoundInfo, StoreView
from petctl.agent.rendezvous import EtcdRendezvous
from petctl.agent.roundjudge import Reform, RequestSave, SaveLook, admission, leave_saves_first
from petctl.agent.workers import WorkerGroup
from petctl.core.records import SaveNow
from petctl.core.spec import JobSpec
from petctl.io import controlfiles
from petctl.io.eventlog import EventLog


class Notice(Protocol):
    """What save first needs of this instance's notice (notices.PreemptionHandler)."""

    notice: Any  # the pending notice, or None
    save_deadline: float

    def plan_leave(self, budget: float) -> None: ...

    def request(self, node_id: str) -> SaveNow: ...


def save_done(workers: WorkerGroup | None, control_dir: Path, nproc: int, deadline: float | None) -> str:
    """Whether this node's workers are done with a requested save, and why: "exited" (none runs, or none
    was started), "saved" (each of the `nproc` local workers reported it in `control_dir`), "deadline"
    (`deadline` passed: time to go, saved or not), or "" while they still save. The one test of "the save
    has finished", for a notice's save (`PreemptionHandler.save_finished`) and for a planned change's
    (`SaveFirst`), checked in that order."""
    if workers is None or not workers.running:
        return "exited"
    if controlfiles.all_saved(control_dir, nproc):
        return "saved"
    if deadline is not None and time.time() >= deadline:
        return "deadline"
    return ""


# --- save first ---------------------------------------------------------------------------------------------
# The round runner's save-now requests, acted on: flag our workers, put ours on the round, say when done.
#
# Three things ask every member's workers to save the same step and exit before the round re-forms: a
# preemption notice of this instance, a graceful leave of this node, and this node admitting a waiting
# node (agent/roundjudge.py decides the last two). All three travel as the round's `save_now` record and
# the node-local `<control>/save_now` flag (io/controlfiles.py), which `petctl.elastic` reads at every step
# boundary. This section does the I/O around those decisions; the round runner (roundrunner.py) calls it.

class SaveFirst:
    """One node's part in save-now requests, for one round at a time (`begin` resets it)."""

    def __init__(self, spec: JobSpec, node_id: str, rdzv: EtcdRendezvous, preemption: Notice,
                 events: EventLog, control_dir: Path) -> None:
        self.spec = spec
        self.node_id = node_id
        self.rdzv = rdzv
        self.preemption = preemption
        self.events = events
        self.control_dir = control_dir
        self.workers: WorkerGroup | None = None
        self.round_no: int | None = None
        self.flagged = False
        self.admitting = False  # the round carries our own admission's request (seen in `flag`)
        self._request: SaveNow | None = None  # the round's request, as last seen
        self._late: SaveNow | None = None  # a request that came after our workers finished (reported)
        # `flag` runs on the round runner's thread, `flag_own` also on the notice's backstop thread
        self._flag_lock = threading.Lock()

    def begin(self, workers: WorkerGroup, round_no: int) -> None:
        with self._flag_lock:
            self.workers, self.round_no = workers, round_no
            self.flagged = self.admitting = False
            self._request = self._late = None

    def _ours(self, request: SaveNow | None) -> bool:
        """`request` is our own admission's (nobody leaves)."""
        return request is not None and request.node_id == self.node_id and not request.leaves

    def _saved(self, request: SaveNow | None) -> bool:
        """Our workers are done with the requested save: all reported it, exited, or its deadline passed."""
        deadline = request.deadline if request is not None else None
        return bool(save_done(self.workers, self.control_dir, self.spec.nproc_per_node, deadline))

    def finished(self) -> bool:
        """A worker of ours exited 0 with no save asked of it: the job's training is over (issue 25).
        Workers that report a save (`saved.<rank>`) exited for a save, whoever flagged it (see
        `workers_saved`)."""
        return (self.workers is not None and not self.flagged and self.workers.some_succeeded()
                and not self.workers_saved())

    def workers_saved(self) -> bool:
        """Some worker of ours reported a save-now save (`saved.<rank>`) this round. That can come before
        the round's request reaches this agent: a noticed node flags its own workers first (`flag_own`), and
        the ranks' all-reduce carries that flag to every rank while etcd may be unreachable."""
        return bool(controlfiles.read_saved(self.control_dir))

    def _look(self, view: StoreView) -> SaveLook:
        request = view.round.save_now if view.round is not None else None
        return SaveLook(node_id=self.node_id, request=request,
                        running=self.workers is not None and self.workers.running, saved=self._saved(request),
                        protocol=controlfiles.speaks_protocol(self.control_dir, self.spec.nproc_per_node),
                        finished=self.finished())

    # --- a request on the round: flag our workers ---------------------------------------------------
    def flag(self, view: StoreView, info: RoundInfo) -> None:
        """Tell our workers the round carries a save-now request (every rank then saves the same step);
        once per round."""
        request = view.round.save_now if view.round is not None else None
        self.admitting, self._request = self._ours(request), request
        with self._flag_lock:
            self._flag(request, info)

    def _flag(self, request: SaveNow | None, info: RoundInfo) -> None:
        if self.flagged or request is None:
            return
        if self.finished():
            # Our workers exited 0 before any save was asked of them: they finished the job's training.
            # Flagging now would make their exits a save's (neither success nor failure), the node would
            # never report them done, and a round that cannot re-form (no capacity to meet --min) would
            # wait for ever with its training over. Once per round.
            if self._late is not request:
                self._late = request
                self.events.emit("save.after_finish", round=info.round, noticed=request.node_id,
                                 reason=request.reason)
            return
        controlfiles.write_save_now(self.control_dir, request.node_id, request.deadline)
        self.flagged = True
        event = "preemption.flagged" if request.reason == "preemption" else "save.flagged"
        self.events.emit(event, round=info.round, noticed=request.node_id, reason=request.reason)
        if (request.node_id == self.node_id and request.leaves and self.workers is not None
                and not controlfiles.speaks_protocol(self.control_dir, self.spec.nproc_per_node)):
            self.workers.signal_all(signal.SIGTERM)  # a plain torchrun script: do what torchrun does

    def flag_own(self, source: str) -> bool:
        """Our instance's notice is handing off: flag our own workers now, before (or without) the round's
        request. The ranks all-reduce the flag at the next step boundary, so every rank of the job saves
        the same step and exits, whether or not etcd carries the announcement to the other agents.
        `source`: who asked (handoff: the round runner; backstop: notices.py's thread at the last moment).
        True when it flagged them now; False when flagged already this round, when no worker runs, or
        when they do not speak the protocol (a plain script gets SIGTERM once the request is on the
        round, as torchrun sends)."""
        with self._flag_lock:
            workers = self.workers
            if (self.flagged or workers is None or not workers.running or self.finished()
                    or not controlfiles.speaks_protocol(self.control_dir, self.spec.nproc_per_node)):
                return False
            deadline = self.preemption.save_deadline
            controlfiles.write_save_now(self.control_dir, self.node_id, deadline)
            self.flagged = True
        self.events.emit("preemption.flagged", round=self.round_no, noticed=self.node_id, reason="preemption",
                         source=source)
        return True

    # --- our notice or leave ------------------------------------------------------------------------
    def announce(self) -> bool:
        """CAS our notice's request onto the round (retried by the round runner until it sticks)."""
        return self.rdzv.set_save_now(self.rdzv.view(), self.preemption.request(self.node_id))

    def defer_leave(self, view: StoreView) -> bool:
        """The agent was asked to leave: True while our workers save first (a planned leave, or a notice
        already under way), False when it is time to stop them and go (nothing to save, or too late)."""
        if self.preemption.notice is None:
            if not leave_saves_first(self._look(view)):
                return False
            self.preemption.plan_leave(self.spec.timeouts.stop_grace)
        return time.time() < self.preemption.save_deadline

    # --- admitting a waiting node -------------------------------------------------------------------
    def admit(self, view: StoreView, info: RoundInfo, cause: str | None, nodes: tuple[str, ...]) -> None:
        """Admit waiting `nodes` (when `cause`), saving first; or re-form once our earlier request's save
        is done. Raises what the etcd calls raise (the round runner counts and retries)."""
        request = view.round.save_now if view.round is not None else None
        if cause is None and not self._ours(request):
            return  # nobody waiting and no admission of ours under way (the usual look): no file I/O
        step = admission(self._look(view), cause, time.time(), self.spec.timeouts.save_deadline)
        if cause is not None and request is None and isinstance(step, RequestSave | Reform):
            self.events.emit("membership.waiting", round=info.round, nodes=list(nodes))
        if isinstance(step, RequestSave):
            if self.rdzv.set_save_now(view, step.request):
                self.events.emit("save.requested", round=info.round, reason=step.request.reason,
                                 deadline=round(step.request.deadline, 3))
        elif isinstance(step, Reform):
            self.rdzv.start_round(view, cause=request.reason if request is not None else (cause or ""))

    def admission_saved(self) -> bool:
        """Our own admission's save looks done: the round runner takes a fresh look at once (and re-forms).
        False for every other request, so a node waiting on someone else's save polls no etcd for it."""
        return self.admitting and self._saved(self._request)
