"""Notices: what the agent does when this instance is told to go (spot interruption, ASG scale-in), when it
is asked to leave, or admits a waiting node, all of which save first; and a rebalance recommendation.

Sections:
- the notice (`PreemptionHandler`, this docstring): its state (the notice, its save deadline, announced,
  timed out) and what the agent does with it;
- `save_done`: the one test of "the save has finished", for a notice's save and a planned change's;
- save first (`SaveFirst`): one node's part in the round's save-now request, whoever asked for it (flag
  our workers, put our notice's or our admission's request on the round, defer a leave while they save);
- the ASG lifecycle actions (the termination hook's heartbeat and completion, the launch hook's);
- the rebalance recommendation's checkpoint request.
The metadata service itself is read in imds.py.

What the agent does with a preemption notice (spot interruption or ASG scale-in), or a graceful leave.

EC2 gives two minutes for a spot notice; we spend them like this (the rules are roundjudge.py's `handoff`):
at the notice, the instance leaves its Auto Scaling group without lowering the desired capacity, so the
replacement is launched at once (`place.detach_for_replacement`); the node puts itself on the round's
`handoffs` and trains on at full world size; it hands off when the replacement waits to join, or at the
last moment that leaves time to save (`handoff_at`, from its measured save and step times), whichever is
first. Handing off is announcing the notice in the round: every node flags its workers and all ranks
save the same step; we wait for the local workers' save with a deadline well inside the notice, leave
the rendezvous so the others re-form at once (admitting the replacement in the same re-form, when it is
there), and end our own instance (`place.end_instance`), so the rest of the window is not billed.

An ASG scale-in notice is announced at once, and the node completes the ASG lifecycle action so the
instance can go: the group wants it gone, and nothing replaces it. A notice seen too late for a save is
announced at once too.

A graceful leave (`petctl scale` down, SIGTERM to the agent) takes the same path when the workers speak
the protocol (agent/roundjudge.py): `plan_leave` records it as a notice of kind `leave`, which saves first
but completes no lifecycle action and waits for no reclaim.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.agent.autoscaling import LaunchCompletion, LifecycleHeartbeat, complete_lifecycle_action
from petctl.agent.decisions import RoundInfo, StoreView
from petctl.agent.rendezvous import EtcdRendezvous
from petctl.agent.roundjudge import (
    SPOT,
    HandoffLook,
    HandoffStep,
    Reform,
    RequestSave,
    SaveLook,
    admission,
    handoff,
    handoff_at,
    leave_saves_first,
    preempted_why,
    save_estimate,
)
from petctl.agent.workers import WorkerGroup
from petctl.core import controlfiles
from petctl.core.eventlog import EventLog
from petctl.core.records import Preempt
from petctl.core.spec import AgentConfig, JobSpec

# --- notices ------------------------------------------------------------------------------------------------

SAFETY_MARGIN = 15.0  # leave this long before the instance is reclaimed ...
SHORT_NOTICE_SHARE = 0.25  # ... or, on a notice shorter than 4 x that, this share of the time left
LEAVE = "leave"  # the kind of a planned leave's notice (spot and asg come from the metadata service)


def save_budget(left: float, preempt_deadline: float) -> float:
    """Seconds the workers get to save, out of `left` before the reclaim. A 2-minute spot notice keeps
    the full margin; a short one (a local `chaos notice --grace 6`, a late-seen notice) keeps a quarter of
    what is left, rather than cutting an upload that would have finished at 1 s."""
    margin = min(SAFETY_MARGIN, max(left, 0.0) * SHORT_NOTICE_SHARE)
    return max(1.0, min(left - margin, preempt_deadline))


class InstancePlace(Protocol):
    """This instance's place in its group (AWS: autoscaling.AwsPlace; local: imds.LocalPlace). Neither
    method raises: a failure is reported by the implementation and answered False."""

    def detach_for_replacement(self) -> bool: ...

    def end_instance(self) -> bool: ...


class LocalPlace:
    """The local provider's instance: its reconciler plays the group, reached through the instance's own
    metadata endpoint (providers/local/metadata_server.py); the agent process is the instance."""

    def __init__(self, imds_endpoint: str, events: EventLog) -> None:
        self.endpoint = imds_endpoint
        self.events = events

    def detach_for_replacement(self) -> bool:
        from petctl.agent.imds import request_detach

        ok = request_detach(self.endpoint)
        self.events.emit("capacity.detached" if ok else "capacity.detach_failed", provider="local")
        return ok

    def end_instance(self) -> bool:
        """Nothing to call: the instance ends when this agent exits, which it does next."""
        self.events.emit("capacity.ending", provider="local")
        return True


def instance_place(config: AgentConfig, events: EventLog) -> InstancePlace | None:
    """This instance's place in its group: AWS's Auto Scaling group where the agent runs in one, the
    local reconciler where a local metadata endpoint stands in for EC2's; None elsewhere."""
    if config.asg_name:
        from petctl.agent.autoscaling import AwsPlace

        return AwsPlace(config, events)
    if config.imds_endpoint:
        return LocalPlace(config.imds_endpoint, events)
    return None


class PreemptionHandler:
    def __init__(self, config: AgentConfig, events: EventLog) -> None:
        self.config = config
        self.events = events
        self.notice: Any = None
        self.noticed_at = 0.0
        self.announced = False
        self.save_deadline = 0.0
        self.place: InstancePlace | None = None  # set by the agent where the provider has one
        self.detached = False  # our instance left its group at the notice: its replacement is launched
        self._marked_round: int | None = None  # the round whose `handoffs` holds us
        self.handoff_why = ""  # why we handed off (roundjudge.HandOff), once we did
        self.timed_out = False  # the workers' save ran past save_deadline
        self._watcher: Any = None
        self._heartbeat: Any = None
        self._lock = threading.Lock()
        self.wake: Callable[[], None] | None = None  # the round runner's wake-up (LiveWatcher.nudge)
        self.on_rebalance: Callable[[Any], None] | None = None  # set by the agent (`RebalanceResponder`)
        self.launch: Any = None  # lifecycle.LaunchCompletion, once registered (AWS)

    def start(self) -> None:
        if not self.config.imds_endpoint:
            return
        from petctl.agent.imds import IMDSWatcher

        self._watcher = IMDSWatcher(self.config.imds_endpoint,
                                    interval=self.config.job.timeouts.imds_interval, log=self.events)
        self._watcher.start(self._on_notice, on_rebalance=self.on_rebalance)

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self.launch is not None:
            self.launch.stop()

    def registered(self) -> None:
        """The agent is registered in the rendezvous, so this instance's boot worked: on AWS, its boot
        record and the launch hook's CONTINUE, in the background (lifecycle.LaunchCompletion)."""
        if self.config.asg_name and self.config.launch_hook and self.launch is None:

            self.launch = LaunchCompletion(self.config, self.events).start()

    @property
    def launch_failures(self) -> int:
        """Failed calls completing the launch hook (and recording the boot), for the node's status."""
        return self.launch.failures if self.launch is not None else 0

    def identity(self) -> dict[str, str]:
        """Instance type, market (spot/on-demand) and AZ from the metadata service, for pricing."""
        return self._watcher.identity() if self._watcher is not None else {}

    def _on_notice(self, notice: Any) -> None:
        with self._lock:
            if self.notice is not None:
                return
            now, most = time.time(), self.config.job.timeouts.preempt_deadline
            self.save_deadline = now + save_budget(notice.deadline - now, most)
            self.noticed_at = now
            self.notice = notice
        self.events.emit("preemption.notice", kind=notice.kind, action=notice.action,
                         deadline=notice.deadline, save_deadline=round(self.save_deadline, 3))
        if self.wake is not None:
            self.wake()  # the round runner weighs it now, not at its next pass
        if notice.kind == SPOT and self.place is not None:
            self.detached = self.place.detach_for_replacement()  # the replacement is launched now

    def handoff_step(self, snap: StoreView, info: RoundInfo, now: float, save_seconds: Sequence[float],
                     step_s: float) -> HandoffStep:
        """What to do about our notice on this pass (roundjudge.handoff), from the round as last seen
        and our measured save (`save_seconds`) and step (`step_s`) times."""
        rnd = snap.round
        save_s = save_estimate(list(save_seconds), self.save_deadline - self.noticed_at)
        look = HandoffLook(kind=self.notice.kind, now=now,
                           handoff_at=handoff_at(self.save_deadline, save_s, step_s),
                           waiting=bool(snap.alive - info.ranks.keys()),
                           marked=self._marked_round == info.round
                           or (rnd is not None and self.config.node_id in rnd.handoffs))
        return handoff(look)

    def mark_handoff(self, rdzv: EtcdRendezvous, info: RoundInfo) -> None:
        """Put our hand-off on the round (CAS on a fresh view; retried by the round runner's next pass
        when the round moved meanwhile). Raises what the etcd calls raise."""
        if rdzv.set_handoff(rdzv.view(), self.notice.deadline):
            self._marked_round = info.round
            self.events.emit("preemption.training_on", round=info.round, deadline=self.notice.deadline,
                             detached=self.detached)

    def end_instance(self) -> bool:
        """Our instance left its group at the notice, and we have left the job: end it now, so the rest
        of the notice window is not billed. False when it was not detached (the reclaim ends it)."""
        if not self.detached or self.place is None:
            return False
        return self.place.end_instance()

    def plan_leave(self, budget: float) -> None:
        """A graceful leave that saves first: a notice of kind `leave`, due in `budget` seconds. A notice
        already pending (a spot notice, say) is kept: it saves first too."""
        from petctl.agent.imds import Notice

        with self._lock:
            if self.notice is not None:
                return
            now = time.time()
            self.save_deadline = now + budget
            self.notice = Notice(LEAVE, LEAVE, now + budget)
        self.events.emit("leave.saving", save_deadline=round(self.save_deadline, 3))

    @property
    def leaving(self) -> bool:
        """The pending notice is our own graceful leave (not a reclaim of the instance)."""
        return self.notice is not None and self.notice.kind == LEAVE

    def request(self, node_id: str) -> Preempt:
        """The save-now request this notice puts on the round."""
        return Preempt(node_id=node_id, deadline=self.notice.deadline,
                       reason=LEAVE if self.leaving else "preemption", leaves=True)

    def announce(self, cas: Callable[[], bool]) -> None:
        """Put the preemption into the current round (retried by the caller's loop until it sticks).

        On AWS the ASG holds the instance in its termination hook meanwhile; we heartbeat the hook so a
        slow save is not cut off at the hook's timeout.
        """
        if cas():
            self.announced = True
            self.events.emit("preemption.announced", deadline=self.notice.deadline, kind=self.notice.kind)
            if (self.config.asg_name and self.config.lifecycle_hook and self._heartbeat is None
                    and not self.leaving):

                self._heartbeat = LifecycleHeartbeat(self.config.asg_name, self.config.lifecycle_hook,
                                                     self.config.node_id, self.config.region, log=self.events)
                self._heartbeat.start()

    def save_finished(self, workers: WorkerGroup, control_dir: Path) -> bool:
        """Our workers saved (or exited), or time is up (`save_deadline`): either way it is time to go. The
        deadline passing is counted (`timed_out`) and reported (`preemption.save_timeout`)."""
        done = save_done(workers, control_dir, workers.spec.nproc, self.save_deadline)
        if done == "deadline":
            self.timed_out = True
            self.events.emit("preemption.save_timeout", save_deadline=self.save_deadline)
        return bool(done)

    def why_stopped(self, control_dir: Path, nproc: int) -> str:
        """How our preempted round ended, in words (`roundjudge.preempted_why`), from what the workers
        left in the control dir: a plain script's SIGTERM is not a "checkpoint done"."""
        saved = controlfiles.read_saved(control_dir)
        return preempted_why(protocol=controlfiles.speaks_protocol(control_dir, nproc),
                             saved=sum(1 for rank in range(nproc) if rank in saved), nproc=nproc,
                             timed_out=self.timed_out)

    def complete_lifecycle(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if not (self.config.asg_name and self.config.lifecycle_hook):
            return

        complete_lifecycle_action(self.config.asg_name, self.config.lifecycle_hook, self.config.node_id,
                                  self.config.region, log=self.events)

    def wait_for_termination(self, stop: threading.Event) -> None:
        """A preempted instance has nothing left to do; idle until it is taken (or told to stop)."""
        deadline = (self.notice.deadline if self.notice is not None else time.time()) + 30.0
        while not stop.is_set() and time.time() < deadline:
            stop.wait(0.5)


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
# node (agent/roundjudge.py decides the last two). All three travel as the round's `preempt` record and the
# node-local `<control>/preempt` flag (core/controlfiles.py), which `petctl.elastic` reads at every step
# boundary. This section does the I/O around those decisions; the round runner (roundrunner.py) calls it.

class SaveFirst:
    """One node's part in save-now requests, for one round at a time (`begin` resets it)."""

    def __init__(self, spec: JobSpec, node_id: str, rdzv: EtcdRendezvous, preemption: PreemptionHandler,
                 events: EventLog, control_dir: Path) -> None:
        self.spec = spec
        self.node_id = node_id
        self.rdzv = rdzv
        self.preemption = preemption
        self.events = events
        self.control_dir = control_dir
        self.workers: WorkerGroup | None = None
        self.flagged = False
        self.admitting = False  # the round carries our own admission's request (seen in `flag`)
        self._request: Preempt | None = None  # the round's request, as last seen

    def begin(self, workers: WorkerGroup) -> None:
        self.workers = workers
        self.flagged = self.admitting = False
        self._request = None

    def _ours(self, request: Preempt | None) -> bool:
        """`request` is our own admission's (nobody leaves)."""
        return request is not None and request.node_id == self.node_id and not request.leaves

    def _saved(self, request: Preempt | None) -> bool:
        """Our workers are done with the requested save: all reported it, exited, or its deadline passed."""
        deadline = request.deadline if request is not None else None
        return bool(save_done(self.workers, self.control_dir, self.spec.nproc_per_node, deadline))

    def finished(self) -> bool:
        """A worker of ours exited 0 with no save asked of it: the job's training is over (issue 25)."""
        return self.workers is not None and not self.flagged and self.workers.some_succeeded()

    def _look(self, snap: StoreView) -> SaveLook:
        request = snap.round.preempt if snap.round is not None else None
        return SaveLook(node_id=self.node_id, request=request,
                        running=self.workers is not None and self.workers.running, saved=self._saved(request),
                        protocol=controlfiles.speaks_protocol(self.control_dir, self.spec.nproc_per_node),
                        finished=request is None and self.finished())

    # --- a request on the round: flag our workers ---------------------------------------------------
    def flag(self, snap: StoreView, info: RoundInfo) -> None:
        """Tell our workers the round carries a save-now request (every rank then saves the same step);
        once per round."""
        request = snap.round.preempt if snap.round is not None else None
        self.admitting, self._request = self._ours(request), request
        if self.flagged or request is None:
            return
        controlfiles.write_preempt(self.control_dir, request.node_id, request.deadline)
        self.flagged = True
        event = "preemption.flagged" if request.reason == "preemption" else "save.flagged"
        self.events.emit(event, round=info.round, noticed=request.node_id, reason=request.reason)
        if (request.node_id == self.node_id and request.leaves and self.workers is not None
                and not controlfiles.speaks_protocol(self.control_dir, self.spec.nproc_per_node)):
            self.workers.signal_all(signal.SIGTERM)  # a plain torchrun script: do what torchrun does

    # --- our notice or leave ------------------------------------------------------------------------
    def announce(self) -> bool:
        """CAS our notice's request onto the round (retried by the round runner until it sticks)."""
        return self.rdzv.set_preempt(self.rdzv.view(), self.preemption.request(self.node_id))

    def defer_leave(self, snap: StoreView) -> bool:
        """The agent was asked to leave: True while our workers save first (a planned leave, or a notice
        already under way), False when it is time to stop them and go (nothing to save, or too late)."""
        if self.preemption.notice is None:
            if not leave_saves_first(self._look(snap)):
                return False
            self.preemption.plan_leave(self.spec.timeouts.stop_grace)
        return time.time() < self.preemption.save_deadline

    # --- admitting a waiting node -------------------------------------------------------------------
    def admit(self, snap: StoreView, info: RoundInfo, cause: str | None, nodes: tuple[str, ...]) -> None:
        """Admit waiting `nodes` (when `cause`), saving first; or re-form once our earlier request's save
        is done. Raises what the etcd calls raise (the round runner counts and retries)."""
        request = snap.round.preempt if snap.round is not None else None
        if cause is None and not self._ours(request):
            return  # nobody waiting and no admission of ours under way (the usual look): no file I/O
        step = admission(self._look(snap), cause, time.time(), self.spec.timeouts.preempt_deadline)
        if cause is not None and request is None and isinstance(step, RequestSave | Reform):
            self.events.emit("membership.waiting", round=info.round, nodes=list(nodes))
        if isinstance(step, RequestSave):
            if self.rdzv.set_preempt(snap, step.request):
                self.events.emit("save.requested", round=info.round, reason=step.request.reason,
                                 deadline=round(step.request.deadline, 3))
        elif isinstance(step, Reform):
            self.rdzv.start_round(snap, cause=request.reason if request is not None else (cause or ""))

    def admission_saved(self) -> bool:
        """Our own admission's save looks done: the round runner takes a fresh look at once (and re-forms).
        False for every other request, so a node waiting on someone else's save polls no etcd for it."""
        return self.admitting and self._saved(self._request)


# --- rebalance recommendations ------------------------------------------------------------------------------
# What the agent does with a rebalance recommendation: ask its workers for a checkpoint now.
#
# A recommendation (imds.py) says this instance is at elevated risk of interruption. It is not a notice:
# nothing is announced in the round and training goes on. The agent writes `<control>/checkpoint`
# (core/controlfiles.py) with the next sequence number; every rank of the job learns of it in the
# preemption check's all-reduce and saves the same step at once (elastic/preemption.py). Whatever comes
# next (the two-minute notice, a late one, none at all before the ASG's Capacity Rebalancing scales this
# instance in) then starts from a checkpoint taken when the risk was announced.

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
