"""One round on one node: start the workers, watch them and `live/`, act on what the judges say, stop.

The decisions are roundjudge.py's pure functions; this module only looks (views, worker polls,
flags) and acts (CAS, events, signals). `run` returns how the round ended, as a `RoundOutcome`.
Every look at `live/` is a fresh view, taken on a watch event or every `VIEW_EVERY` seconds (longer
in a fleet of over 200 nodes: `decisions.safety_period`), so a missed watch event costs latency, never
correctness. The first look of a round comes `decisions.first_look_after(rank)` after its start unless an
event asks sooner: a node admitted on the round record follows `live/` from the round's freeze on, and
the fleet's nodes do not all read it whole at the same moment. After it, a wake by watch events folds
those events into the view (`EtcdRendezvous.view_since`) instead of reading `live/` whole: one change
costs each node its events, not every node's key.

etcd is needed only to change membership, so a failed etcd call ends nothing here: the workers keep
training, the look or the write is tried again on the next pass (a node's `done` mark and a restart
request are kept until they are stored), and the failures are counted and reported once per outage by
the agent's `StoreHealth`. Two things happen only because of the store:
- a view without any round while we run one (etcd replaced by an empty one): we write our round back
  (the agent's `rebuild`), and the job carries on in it;
- cut off from etcd past the heartbeat TTL while our workers stalled: we fence (health.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from petctl.agent.decisions import EndJob, RoundInfo, Settings, StoreView, first_look_after, safety_period
from petctl.agent.health import FenceLook, OutageReporter, fence, should_fence
from petctl.agent.liveness import Heartbeat, PeerWatch
from petctl.agent.notices import PreemptionHandler
from petctl.agent.rendezvous import EtcdRendezvous, LiveWatcher
from petctl.agent.reporting import Progress, StatusPublisher
from petctl.agent.roundjudge import (
    AskRestart,
    Continue,
    FailedAfterFinish,
    HandOff,
    MarkHandoff,
    MembershipChange,
    Over,
    Rebuild,
    ReportFailure,
    ReportHang,
    RoundOutcome,
    StopLingering,
    Succeeded,
    Timing,
    Workers,
    WorkerWatch,
    hang_limit,
    judge,
    judge_workers,
)
from petctl.agent.savefirst import SaveFirst
from petctl.agent.workers import WarmPool, WorkerGroup, WorkerSpec, refill, refill_due, round_env
from petctl.core.records import Phase, Round
from petctl.core.spec import JobSpec
from petctl.io import controlfiles
from petctl.io.eventlog import EventLog
from petctl.io.store import store_errors

# --- the round runner ---------------------------------------------------------------------------------------

VIEW_EVERY = 2.0  # a fresh look at live/ even without a watch event
PASS = 0.1  # the round loop's pass when nothing wakes it
SAVING_PASS = 0.02  # ... while our workers save for a re-form: its end is seen by polling their files
PUBLISH_EVERY = 5.0  # how often the status is offered to StatusPublisher, which puts it only when due


@dataclass
class RoundParts:
    """The agent's long-lived parts a round uses (built and started by Agent)."""

    spec: JobSpec
    node_id: str
    settings: Settings
    events: EventLog
    rdzv: EtcdRendezvous
    watcher: LiveWatcher
    heartbeat: Heartbeat
    peers: PeerWatch | None  # watches the next member while a round runs (None: only the TTL drops nodes)
    preemption: PreemptionHandler
    status: StatusPublisher
    progress: Progress
    leave: threading.Event
    control_dir: Path
    work_dir: Path
    out: IO[str]
    worker_spec: WorkerSpec
    pool: WarmPool | None
    rebuild: Callable[[Round], None]  # write a round etcd lost back (Agent.rebuild_store)
    depart: Callable[[str], None]  # leave the job in etcd (Agent._depart), our workers may still exit
    snapshot_dir: Path | None = None  # the workers' in-memory snapshots (agent/snapshots.py); None: none


class RoundRunner:
    def __init__(self, parts: RoundParts) -> None:
        self.p = parts
        t = parts.spec.timeouts
        self.timing = Timing(finish_grace=t.finish_grace, fail_grace=t.heartbeat_ttl + t.heartbeat_interval)
        self.outage = OutageReporter("round", parts.events.emit, parent=parts.rdzv.store)
        self.errors = store_errors()
        self._done_pending: tuple[int, str] | None = None  # (round, mixed failure): done, mark not stored
        self._fenced = False
        self.saves = SaveFirst(parts.spec, parts.node_id, parts.rdzv, parts.preemption, parts.events,
                               parts.control_dir)
        parts.preemption.flag_own = self.saves.flag_own  # the notice's backstop flags our workers with it

    def run(self, info: RoundInfo) -> RoundOutcome:
        p = self.p
        p.status.round = info
        p.progress.begin_round(info.round)
        controlfiles.clear(p.control_dir, markers=True)
        workers = WorkerGroup(p.worker_spec, p.out, on_event=p.progress.on_worker_event, pool=p.pool)
        workers.start(node_rank=info.rank, num_nodes=info.world_size, master_addr=info.master_addr,
                      master_port=info.master_port, restart_count=info.round - 1,
                      max_restarts=p.spec.max_restarts, run_id=p.spec.name,
                      extra_env=round_env(p.spec, p.node_id, info.round, p.control_dir, p.work_dir,
                                          p.snapshot_dir))
        # `cpu_s`: this agent's CPU seconds so far, as `rendezvous.complete` has them: what starting the
        # workers cost the agent is the difference (bench P5 reports it).
        p.events.emit("workers.started", round=info.round, rank=info.rank, world_size=info.world_size,
                      nproc=p.spec.nproc_per_node, warm=workers.warm_started, warm_ready=workers.warm_ready,
                      cpu_s=round(time.process_time(), 3))
        p.status.set_state("running")
        if p.peers is not None:
            p.peers.watch(info)
        self.saves.begin(workers, info.round)
        watch = WorkerWatch()
        self._fenced, self._done_pending = False, None
        started = last_publish = self._started = time.monotonic()
        next_view = started + first_look_after(info.rank)
        view = StoreView(round=info.record, alive=frozenset(info.ranks))  # until the first look
        while True:
            if p.leave.is_set() and not self.saves.defer_leave(view):
                return self._stop(workers, info, RoundOutcome.LEAVE)
            if p.preemption.notice is not None and not p.preemption.announced and not self.saves.finished():
                self._hand_off(view, info)  # once our workers finished unasked there is nothing to save
            woke = p.watcher.wait(SAVING_PASS if self.saves.flagged else PASS)
            now = time.monotonic()
            due = now >= next_view or self.saves.admission_saved()
            if woke or due:
                if due:  # a whole read; on a watch's events alone, they are folded into our view
                    next_view = now + safety_period(VIEW_EVERY, len(view.alive), p.node_id)
                looked = self._look(info, None if due else view)
                if looked is not None:
                    view, outcome = looked
                    if outcome is not None:
                        return self._end(workers, info, view, outcome)
                    self.saves.flag(view, info)
            if p.preemption.announced and p.preemption.save_finished(workers, p.control_dir):
                left = RoundOutcome.LEAVE if p.preemption.leaving else RoundOutcome.PREEMPTED
                p.depart("leave" if left is RoundOutcome.LEAVE else "preemption")  # before they exit
                return self._stop(workers, info, left)
            if not self._fenced:
                self._fence_if_cut_off(workers, info, watch, now)
                watch = self._watch_workers(watch, workers, view, info, now)
            if self._done_pending is not None:
                self._store_call(self._mark_done)
            if now - last_publish > PUBLISH_EVERY:
                last_publish = now
                p.status.publish()
            if p.pool is not None:  # when, and at which CPU priority: refill_due
                look = p.pool.refill_look(now - started, bool(p.progress.round_step_seen))
                refill(p.pool, refill_due(look), info.round, p.events)

    def _hand_off(self, view: StoreView, info: RoundInfo) -> None:
        """Our instance has a notice: train on, or hand off now (roundjudge.handoff)."""
        p = self.p
        self._store_call(p.preemption.writer_save, p.rdzv, info)  # once per round; unknown: hand off now
        step = p.preemption.handoff_step(view, info, time.time())
        if isinstance(step, HandOff):
            if p.preemption.handoff_why != step.why:  # once per reason, not once per pass
                p.preemption.handoff_why = step.why
                p.events.emit("preemption.handoff", round=info.round, why=step.why,
                              waiting=sorted(view.alive - info.ranks.keys()), step=p.progress.step,
                              save_estimate_s=round(p.preemption.save_s, 3))
            self.saves.flag_own("handoff")  # the save first, through the workers: it needs no etcd
            self._store_call(p.preemption.announce, self.saves.announce)
        elif isinstance(step, MarkHandoff):
            self._store_call(p.preemption.mark_handoff, p.rdzv, info)

    def _store_call(self, fn: Callable[..., object], *args: object) -> bool:
        """Run an etcd call of the round; False (counted, reported once per outage) if etcd failed."""
        try:
            fn(*args)
        except self.errors as e:
            self.outage.failed(e)
            return False
        self.outage.succeeded()
        return True

    def _look(self, info: RoundInfo, since: StoreView | None = None
              ) -> tuple[StoreView, RoundOutcome | None] | None:
        """A fresh view and what it means for us; None when etcd did not answer (try again later). With
        `since`, the view it follows with the watches' events folded in, when they hold every change
        (`EtcdRendezvous.view_since`), else a whole read."""
        try:
            view = self.p.rdzv.view() if since is None else self.p.rdzv.view_since(since)
            outcome = self._act(view, info)
            if outcome is None and self._fenced:
                # Our workers are stopped but the round is still ours: etcd answers again; open the next.
                self.p.rdzv.start_round(view, cause=f"{self.p.node_id} fenced while cut off from etcd")
                outcome = RoundOutcome.FENCED
        except self.errors as e:
            self.outage.failed(e)
            return None
        self.outage.succeeded()
        return view, outcome

    def _fence_if_cut_off(self, workers: WorkerGroup, info: RoundInfo, watch: WorkerWatch,
                          now: float) -> None:
        p = self.p
        look = FenceLook(unreachable_for=p.rdzv.store.unreachable_for(),
                         stalled_for=p.progress.stalled_for(now), longest_gap=p.progress.longest_gap,
                         workers_running=workers.running and not watch.finished)
        if should_fence(look, p.spec.timeouts.heartbeat_ttl):
            self._fenced = True
            p.status.set_state("fenced")
            fence(look, info.round, p.control_dir, p.events, lambda: workers.stop(p.spec.timeouts.stop_grace))

    def _ask_restart(self, info: RoundInfo, cause: str) -> None:
        """Replace our round after a worker failure; one already replaced covers ours (left alone)."""
        view = self.p.rdzv.view()
        if view.round is not None and view.round.round == info.round:
            self.p.rdzv.start_round(view, cause, failure=True)

    def _mark_done(self) -> None:
        if self._done_pending is not None:
            self.p.rdzv.mark_done(*self._done_pending)
        self._done_pending = None

    # --- live/ ---------------------------------------------------------------------------------------
    def _act(self, view: StoreView, info: RoundInfo) -> RoundOutcome | None:
        """Act on what the view means; the outcome if the round is over for us."""
        p = self.p
        verdict = judge(view, info, p.settings, finishing=self.saves.finished())
        if isinstance(verdict, Over):
            return verdict.outcome
        if isinstance(verdict, MembershipChange) and verdict.event == "membership.waiting":
            self.saves.admit(view, info, verdict.cause, verdict.nodes)  # planned: save first
        elif isinstance(verdict, MembershipChange):
            p.events.emit(verdict.event, round=info.round, nodes=list(verdict.nodes))
            p.rdzv.start_round(view, cause=verdict.cause)
        elif isinstance(verdict, Continue):
            self.saves.admit(view, info, None, ())  # our admission's save may be done
        elif isinstance(verdict, EndJob):
            p.rdzv.end_job(verdict.state, verdict.reason, verdict.round)
        elif isinstance(verdict, Rebuild):
            p.rebuild(verdict.round)
        return None

    # --- the workers ---------------------------------------------------------------------------------
    def _watch_workers(self, watch: WorkerWatch, workers: WorkerGroup, view: StoreView, info: RoundInfo,
                       now: float) -> WorkerWatch:
        p = self.p
        # A save-now request on the round makes our workers' exits a save's, unless they exited 0 before
        # any save was asked of them (`SaveFirst.finished`): then they finished the training, and the node
        # must say so, or it waits on a re-form that a finished job never gets. Workers that reported a
        # save exited for one even before the request reached us (`SaveFirst.workers_saved`; read only
        # once a worker exited 0, so a running round reads no file for it).
        requested = view.round is not None and view.round.save_now is not None
        saved = workers.some_succeeded() and self.saves.workers_saved()  # then never `finished`
        saving_now = saved or (requested and not self.saves.finished())
        result = None if watch.finished or saving_now else workers.poll()
        seen = p.progress.progress_at if p.progress.reporting else workers.output_at  # see hang_limit
        look = Workers(exited=result is not None, succeeded=bool(result and result.succeeded),
                       first_failure=result.first_failure() if result else None,
                       some_succeeded=workers.some_succeeded(), running=workers.running,
                       round_done_elsewhere=bool(view.done_in(info.round)), saving_now=saving_now,
                       idle=now - max(self._started, seen or 0.0), exiting_since=workers.exiting_since())
        hang = hang_limit(p.spec.timeouts.hang, p.progress.reporting, seen is not None)
        step, new = judge_workers(watch, look, now, replace(self.timing, hang=hang), p.node_id)
        if isinstance(step, StopLingering | FailedAfterFinish):  # the latter a mixed ending: never restarted
            p.events.emit("workers.failed_after_finish" if (mixed := isinstance(step, FailedAfterFinish))
                          else "workers.lingered", round=info.round,
                          **({"failure": new.failure} if mixed
                             else {"seconds": step.seconds, "cause": step.cause}))
            workers.stop(p.spec.timeouts.stop_grace)
            self._done_pending = (info.round, new.failure if mixed else "")  # stored by the loop, later
            p.status.set_state("succeeded")
        elif isinstance(step, Succeeded):
            self._done_pending = (info.round, "")
            p.events.emit("workers.succeeded", round=info.round)
            p.status.set_state("succeeded")
        elif isinstance(step, ReportHang):
            p.status.last_error = [new.failure]
            p.events.emit("workers.hung", round=info.round, reason=new.failure, last_step=p.progress.step)
        elif isinstance(step, ReportFailure):
            p.status.last_error = workers.error_tail(step.local_rank)
            p.events.emit("workers.failed", round=info.round, local_rank=step.local_rank, code=step.code,
                          last_error=p.status.last_error)
        elif isinstance(step, AskRestart):
            # Only once a settled view was judged: a peer lost during a store outage (which made our
            # workers fail) is then a membership change, not a failure counted against max_restarts.
            settled = view.settled and p.rdzv.store.settled()
            if not settled or not self._store_call(self._ask_restart, info, step.cause):
                return watch  # not asked yet: the next pass asks again
        return new

    def _end(self, workers: WorkerGroup, info: RoundInfo, view: StoreView,
             outcome: RoundOutcome) -> RoundOutcome:
        """The round was replaced: join the new one before our workers stop (they may take seconds to
        handle SIGTERM), so its closer, which waits for the members of this round, is not kept waiting.
        Not a node on its way out (asked to leave, or preempted): the closer should not count on it."""
        p, rnd = self.p, view.round
        staying = not p.leave.is_set() and p.preemption.notice is None
        if (outcome in (RoundOutcome.NEXT_ROUND, RoundOutcome.FENCED) and staying and rnd is not None
                and rnd.phase is Phase.JOINING and rnd.round is not None and p.node_id in view.alive):
            self._store_call(p.rdzv.prejoin, rnd.round, info.rank)  # else the rendezvous joins
        return self._stop(workers, info, outcome)

    def _stop(self, workers: WorkerGroup, info: RoundInfo, outcome: RoundOutcome) -> RoundOutcome:
        p = self.p
        if p.peers is not None:
            p.peers.clear()
        t0 = time.monotonic()
        p.status.set_state("stopping")
        codes = workers.stop(p.spec.timeouts.stop_grace)
        why = (p.preemption.why_stopped(p.control_dir, p.spec.nproc_per_node)
               if outcome is RoundOutcome.PREEMPTED else outcome.value)
        p.events.emit("workers.stopped", round=info.round, why=why, codes=codes,
                      seconds=round(time.monotonic() - t0, 3))
        span = p.progress.span
        # One line per round with its step span: enough for goodput (kept vs lost steps) later.
        p.events.emit("round.summary", round=info.round, rank=info.rank, world_size=info.world_size,
                      started=round(workers.started_at, 3), ended=round(time.time(), 3), why=why,
                      first_step=span.get("first"), last_step=span.get("last"),
                      first_step_ts=span.get("first_ts"), last_step_ts=span.get("last_ts"))
        return outcome
