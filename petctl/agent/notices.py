"""Notices: what the agent does when this instance is told to go (a spot interruption, an ASG scale-in), or
is asked to leave: the notice's state, and when it hands off.

One home per idea on a notice's path: the metadata service is read in imds.py; the notice's state and its
hand-off are here (`PreemptionHandler`, rules in roundjudge.py); every rank's save is savefirst.py's; the
instance's calls to its group (detach, lifecycle actions, ending itself) are autoscaling.py's; a
rebalance recommendation's checkpoint request is rebalance.py's.

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

The save itself does not wait on etcd. At the hand-off the node first flags its own workers
(`SaveFirst.flag_own`); the ranks all-reduce that flag at the next step boundary, so every rank of the job
saves the same step even when no other agent has read the announcement yet. A backstop thread does the
same just after the last moment (`last_moment`) when the round runner has not handed off by then, as when
an etcd call holds it through a stalled etcd (`preemption.backstop`). The announcement then only tells
the agents.

An ASG scale-in notice is announced at once, and the node completes the ASG lifecycle action so the
instance can go: the group wants it gone, and nothing replaces it. A notice seen too late for a save is
announced at once too.

A graceful leave (`petctl scale` down, SIGTERM to the agent) takes the same path when the workers speak
the protocol (agent/roundjudge.py): `plan_leave` records it as a notice of kind `leave`, which saves first
but completes no lifecycle action and waits for no reclaim.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.agent.autoscaling import (
    InstancePlace,
    LaunchCompletion,
    LifecycleHeartbeat,
    complete_lifecycle_action,
)
from petctl.agent.decisions import RoundInfo, StoreView
from petctl.agent.rendezvous import EtcdRendezvous
from petctl.agent.roundjudge import (
    SPOT,
    HandoffLook,
    HandoffStep,
    handoff,
    handoff_at,
    preempted_why,
    save_estimate,
)
from petctl.agent.savefirst import save_done
from petctl.agent.workers import WorkerGroup
from petctl.core.records import NodeStatus, SaveNow, WireFormatError
from petctl.core.spec import AgentConfig
from petctl.io import controlfiles
from petctl.io.eventlog import EventLog
from petctl.io.threads import Service

SAFETY_MARGIN = 15.0  # leave this long before the instance is reclaimed ...
SHORT_NOTICE_SHARE = 0.25  # ... or, on a notice shorter than 4 x that, this share of the time left
LEAVE = "leave"  # the kind of a planned leave's notice (spot and asg come from the metadata service)
BACKSTOP_POLL = 0.1  # seconds between the backstop's looks at the clock (it reads no etcd, no file)
# The backstop acts once the round runner is this late for the last moment. It passes every 0.1 s when
# etcd answers, so that late it is held (in an etcd call); the save's estimate keeps a second of slack.
BACKSTOP_LATE = 0.5


def save_budget(left: float, save_deadline: float) -> float:
    """Seconds the workers get to save, out of `left` before the reclaim. A 2-minute spot notice keeps
    the full margin; a short one (a local `chaos notice --grace 6`, a late-seen notice) keeps a quarter of
    what is left, rather than cutting an upload that would have finished at 1 s."""
    margin = min(SAFETY_MARGIN, max(left, 0.0) * SHORT_NOTICE_SHARE)
    return max(1.0, min(left - margin, save_deadline))


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
        self.writer_save_s: float | None = None  # rank 0's latest save time, as it published it
        self.save_s = 0.0  # the time kept for the hand-off's save, as last planned (for its event)
        self._writer_read: int | None = None  # the round whose rank 0 status we read
        self.timed_out = False  # the workers' save ran past save_deadline
        self._watcher: Any = None
        self._heartbeat: Any = None
        self._lock = threading.Lock()
        self.wake: Callable[[], None] | None = None  # the round runner's wake-up (LiveWatcher.nudge)
        self.on_rebalance: Callable[[Any], None] | None = None  # set by the agent (`RebalanceResponder`)
        self.launch: Any = None  # lifecycle.LaunchCompletion, once registered (AWS)
        self.progress: Any = None  # reporting.Progress (set by the agent): our measured save and step times
        # Flags this node's workers for the save, once per round (SaveFirst.flag_own, set by the round
        # runner); called by the backstop at the last moment. True when it flagged them just now.
        self.flag_own: Callable[[str], bool] | None = None
        self._backstop = Service("notice-backstop", self._backstop_loop)

    def start(self) -> None:
        if not self.config.imds_endpoint:
            return
        from petctl.agent.imds import IMDSWatcher

        self._watcher = IMDSWatcher(self.config.imds_endpoint,
                                    interval=self.config.job.timeouts.imds_interval, log=self.events)
        self._watcher.start(self._on_notice, on_rebalance=self.on_rebalance)

    def stop(self) -> None:
        if not self._backstop.stop(timeout=1.0):
            self.events.emit("notice_backstop.lingered")
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
            now, most = time.time(), self.config.job.timeouts.save_deadline
            self.save_deadline = now + save_budget(notice.deadline - now, most)
            self.noticed_at = now
            self.notice = notice
        self.events.emit("preemption.notice", kind=notice.kind, action=notice.action,
                         deadline=notice.deadline, save_deadline=round(self.save_deadline, 3))
        if self.wake is not None:
            self.wake()  # the round runner weighs it now, not at its next pass
        self._backstop.start()
        if notice.kind == SPOT and self.place is not None:
            self.detached = self.place.detach_for_replacement()  # the replacement is launched now

    def last_moment(self) -> float:
        """The last moment to ask for the save (roundjudge.handoff_at): our measured save and step times
        (`progress`), and rank 0's published save time. Also keeps the save's estimate (`save_s`) for
        the hand-off's events. Safe from any thread."""
        saves, step_s = self.progress.plan_times() if self.progress is not None else ((), 0.0)
        writer = self.writer_save_s
        measured = [*saves, *([writer] if writer is not None else [])]
        self.save_s = save_estimate(measured, self.save_deadline - self.noticed_at)
        return handoff_at(self.save_deadline, self.save_s, step_s)

    def handoff_step(self, view: StoreView, info: RoundInfo, now: float) -> HandoffStep:
        """What to do about our notice on this pass (roundjudge.handoff), from the round as last seen."""
        rnd = view.round
        look = HandoffLook(kind=self.notice.kind, now=now, handoff_at=self.last_moment(),
                           waiting=bool(view.alive - info.ranks.keys()),
                           marked=self._marked_round == info.round
                           or (rnd is not None and self.config.node_id in rnd.handoffs))
        return handoff(look)

    def _backstop_loop(self) -> None:
        """From the notice until the agent stops: just after the last moment, flag our own workers if the
        round runner has not (`flag_own` is a no-op then). It reads only the clock and our measurements, so a
        round runner held in an etcd call that a stalled etcd never answers cannot make the save late:
        the workers' all-reduce carries the flag to every rank. Said once per round it acted in."""
        while not self._backstop.stopping.wait(BACKSTOP_POLL):
            if self.notice is None or self.leaving or time.time() < self.last_moment() + BACKSTOP_LATE:
                continue
            flag = self.flag_own
            if flag is not None and flag("backstop"):
                self.events.emit("preemption.backstop", save_deadline=round(self.save_deadline, 3),
                                 save_estimate_s=round(self.save_s, 3))

    def writer_save(self, rdzv: EtcdRendezvous, info: RoundInfo) -> None:
        """How long rank 0's latest save took, from its published status (`Checkpoint.save_s`): under DDP
        rank 0 writes for every rank, so a noticed node of another rank has no save of its own to go
        by. Read once per round. Raises what the etcd calls raise."""
        writer = next((node for node, rank in info.ranks.items() if rank == 0), None)
        if writer is None or writer == self.config.node_id or self._writer_read == info.round:
            return
        entry = rdzv.kv.get(rdzv.keys.node_status(writer))
        self._writer_read = info.round
        try:
            status = NodeStatus.from_json(entry.value) if entry is not None else None
        except WireFormatError:
            status = None
        save_s = status.last_checkpoint.save_s if status and status.last_checkpoint else None
        self.writer_save_s = save_s if isinstance(save_s, int | float) else self.writer_save_s

    def mark_handoff(self, rdzv: EtcdRendezvous, info: RoundInfo) -> None:
        """Put our hand-off on the round (CAS on a fresh view; retried by the round runner's next pass
        when the round moved meanwhile). Raises what the etcd calls raise."""
        if rdzv.set_handoff(rdzv.view(), self.notice.deadline):
            self._marked_round = info.round
            self.events.emit("preemption.training_on", round=info.round, deadline=self.notice.deadline,
                             detached=self.detached, save_estimate_s=round(self.save_s, 3))

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

    def request(self, node_id: str) -> SaveNow:
        """The save-now request this notice puts on the round."""
        return SaveNow(node_id=node_id, deadline=self.notice.deadline,
                       reason=LEAVE if self.leaving else "preemption", leaves=True)

    def announce(self, cas: Callable[[], bool]) -> None:
        """Put this notice's save-now request on the current round (retried by the caller's loop until it
        sticks).

        On AWS the ASG holds the instance in its termination hook meanwhile; we heartbeat the hook so a
        slow save is not cut off at the hook's timeout.
        """
        if cas():
            self.announced = True
            self.events.emit("preemption.announced", deadline=self.notice.deadline, kind=self.notice.kind)
            if (self.config.asg_name and self.config.lifecycle_hook and self._heartbeat is None
                    and not self.leaving and not self.detached):  # a detached instance has no hook

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
        if not (self.config.asg_name and self.config.lifecycle_hook) or self.detached:
            return  # no group, or no longer in it: no lifecycle action is pending for this instance

        complete_lifecycle_action(self.config.asg_name, self.config.lifecycle_hook, self.config.node_id,
                                  self.config.region, log=self.events)

    def wait_for_termination(self, stop: threading.Event) -> None:
        """A preempted instance has nothing left to do; idle until it is taken (or told to stop)."""
        deadline = (self.notice.deadline if self.notice is not None else time.time()) + 30.0
        while not stop.is_set() and time.time() < deadline:
            stop.wait(0.5)
