"""What the agent does with a preemption notice (spot interruption or ASG scale-in), or a graceful leave.

EC2 gives two minutes; we spend them like this: announce the preemption in the round (so every node
flags its workers and all ranks save the same step), wait for the local workers' save with a deadline well
inside the notice, leave the rendezvous so the others re-form at once, and complete the ASG lifecycle
action so the instance can go. The metadata watcher and lifecycle client live in imds.py/lifecycle.py.

A graceful leave (`petctl scale` down, SIGTERM to the agent) takes the same path when the workers speak
the protocol (agent/planned.py): `plan_leave` records it as a notice of kind `leave`, which saves first
but completes no lifecycle action and waits for no reclaim.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.agent.roundjudge import preempted_why
from petctl.agent.workers import WorkerGroup
from petctl.core import controlfiles
from petctl.core.eventlog import EventLog
from petctl.core.records import Preempt
from petctl.core.spec import AgentConfig

SAFETY_MARGIN = 15.0  # leave this long before the instance is reclaimed ...
SHORT_NOTICE_SHARE = 0.25  # ... or, on a notice shorter than 4 x that, this share of the time left
LEAVE = "leave"  # the kind of a planned leave's notice (spot and asg come from the metadata service)


def save_budget(left: float, preempt_deadline: float) -> float:
    """Seconds the workers get to save, out of `left` before the reclaim. A 2-minute spot notice keeps
    the full margin; a short one (a local `chaos notice --grace 6`, a late-seen notice) keeps a quarter of
    what is left, rather than cutting an upload that would have finished at 1 s."""
    margin = min(SAFETY_MARGIN, max(left, 0.0) * SHORT_NOTICE_SHARE)
    return max(1.0, min(left - margin, preempt_deadline))


class PreemptionHandler:
    def __init__(self, config: AgentConfig, events: EventLog) -> None:
        self.config = config
        self.events = events
        self.notice: Any = None
        self.announced = False
        self.save_deadline = 0.0
        self.timed_out = False  # the workers' save ran past save_deadline
        self._watcher: Any = None
        self._heartbeat: Any = None
        self._lock = threading.Lock()
        self.wake: Callable[[], None] | None = None  # the round runner's wake-up (LiveWatcher.nudge)
        self.on_rebalance: Callable[[Any], None] | None = None  # set by the agent (agent/rebalance.py)
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
            from petctl.agent.lifecycle import LaunchCompletion

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
            self.notice = notice
        self.events.emit("preemption.notice", kind=notice.kind, action=notice.action,
                         deadline=notice.deadline, save_deadline=round(self.save_deadline, 3))
        if self.wake is not None:
            self.wake()  # announce it now, not at the round runner's next pass

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
                from petctl.agent.lifecycle import LifecycleHeartbeat

                self._heartbeat = LifecycleHeartbeat(self.config.asg_name, self.config.lifecycle_hook,
                                                     self.config.node_id, self.config.region, log=self.events)
                self._heartbeat.start()

    def save_finished(self, workers: WorkerGroup, control_dir: Path) -> bool:
        """Our workers saved (or exited), or time is up: either way it is time to go."""
        if not workers.running:
            return True
        if controlfiles.all_saved(control_dir, workers.spec.nproc):
            return True
        if time.time() >= self.save_deadline:
            self.timed_out = True
            self.events.emit("preemption.save_timeout", save_deadline=self.save_deadline)
            return True
        return False

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
        from petctl.agent.lifecycle import complete_lifecycle_action

        complete_lifecycle_action(self.config.asg_name, self.config.lifecycle_hook, self.config.node_id,
                                  self.config.region, log=self.events)

    def wait_for_termination(self, stop: threading.Event) -> None:
        """A preempted instance has nothing left to do; idle until it is taken (or told to stop)."""
        deadline = (self.notice.deadline if self.notice is not None else time.time()) + 30.0
        while not stop.is_set() and time.time() < deadline:
            stop.wait(0.5)
