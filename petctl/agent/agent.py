"""The elastic agent: one per instance, beside the workers. Never imports torch.

Loop: rendezvous -> start workers -> watch (membership, workers, job end, preemption notices) -> stop
workers and rendezvous again. Every decision is taken on a fresh etcd snapshot, so a missed watch event
costs latency, never correctness. Why a global restart on every membership change: collective
libraries (gloo, NCCL) cannot shrink or grow a live process group, and a peer that vanished leaves the
others blocked in a collective; restarting every worker from the newest checkpoint is the one robust
answer, and it is what torchrun does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import etcd

from petctl.agent.code import fetch_code
from petctl.agent.eventsink import EtcdEventSink
from petctl.agent.heartbeat import Heartbeat
from petctl.agent.mirror import Mirror
from petctl.agent.preemption import PreemptionHandler
from petctl.agent.rendezvous import (
    EtcdRendezvous,
    JobEnded,
    LiveWatcher,
    RendezvousAborted,
    RequestStats,
    RoundInfo,
    Snapshot,
)
from petctl.agent.warm_pool import WarmPool
from petctl.agent.workers import WorkerGroup, WorkerSpec
from petctl.core import controlfiles
from petctl.core.eventlog import EventLog
from petctl.core.keys import JobKeys
from petctl.core.spec import AgentConfig
from petctl.io.etcd import etcd_client
from petctl.io.procs import die_with_parent

STATUS_TTL = 120
WARM_WAIT = 60.0  # longest a node waits for its warm workers' imports before it joins anyway
PUBLISH_EVERY = 5.0


class Agent:
    def __init__(self, config: AgentConfig, out: IO[str] | None = None, log_path: Path | None = None) -> None:
        self.config = config
        self.spec = config.job
        self.t = config.job.timeouts
        self.out = out or sys.stdout
        self.node_id = config.node_id
        self.keys = JobKeys(self.spec.name)
        self.events = EventLog("agent", stream=self.out, job=self.spec.name, node=self.node_id)
        self.work_dir = Path(config.work_dir or os.getcwd())
        self.control_dir = self.work_dir / "control"
        self.stats = RequestStats()
        self.leave = threading.Event()
        self.client = etcd_client(self.spec.etcd_endpoint)
        self.watcher = LiveWatcher(etcd_client(self.spec.etcd_endpoint, read_timeout=30), self.keys.live,
                                   self.stats)
        self.heartbeat = Heartbeat(etcd_client(self.spec.etcd_endpoint), self.keys, self.node_id,
                                   config.host_addr, os.getpid(), self.t.heartbeat_interval,
                                   self.t.heartbeat_ttl)
        self.rdzv = EtcdRendezvous(self.client, self.spec.name, self.node_id, config.host_addr,
                                   self.spec.min_size, self.spec.max_size, self.spec.max_restarts, self.t,
                                   self.events, self.watcher, self.stats, initial_size=self.spec.size)
        self.rdzv.on_result = self._on_result
        self.preemption = PreemptionHandler(config, self.events)
        self.event_sink = EtcdEventSink(etcd_client(self.spec.etcd_endpoint), self.keys.events)
        self.events.add_sink(self.event_sink)
        self.mirror = (Mirror(config.status_url, self.node_id, log_path, log=self.events)
                       if config.status_url else None)
        if self.mirror is not None:
            self.events.add_sink(self.mirror.add_event)
        self.progress: dict[str, Any] = {"step": None, "last_checkpoint": None}
        self.round: RoundInfo | None = None
        self.round_steps: dict[str, Any] = {}  # first/last step of the current round (goodput)
        self.state = "starting"

    # --- lifecycle ---------------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.leave.set())
        signal.signal(signal.SIGINT, lambda *_: self.leave.set())
        self.event_sink.start()
        if self.mirror is not None:
            self.mirror.start()
        self.preemption.start()
        self.events.emit("agent.started", host=self.config.host_addr, pid=os.getpid(),
                         min=self.spec.min_size, max=self.spec.max_size, nproc=self.spec.nproc_per_node,
                         **self.preemption.identity())
        code_dir = self.work_dir / "code"
        if self.spec.code_url:
            fetch_code(self.spec.code_url, code_dir)
        else:
            code_dir = self.work_dir
        self.worker_spec = WorkerSpec(cmd=[sys.executable, "-u", self.spec.entrypoint, *self.spec.args],
                                      cwd=str(code_dir), nproc=self.spec.nproc_per_node,
                                      base_env=dict(self.spec.env))
        self.worker_spec.preload += tuple(self.spec.warm_imports)
        self.pool = WarmPool(self.worker_spec, die_with_parent()) if self.spec.warm_workers else None
        if self.pool is not None:
            # Join only once our workers have torch imported: a new node would otherwise restart a
            # running job and then make everyone wait for its imports (bounded: never wait forever).
            t0 = time.monotonic()
            self.pool.fill()
            ready = self.pool.wait_ready(WARM_WAIT)
            self.events.emit("workers.warm_ready", count=ready, seconds=round(time.monotonic() - t0, 3))
        self.heartbeat.start()
        self.watcher.start()
        try:
            return self._loop()
        finally:
            self.preemption.stop()
            self.watcher.stop()
            self.event_sink.stop()
            if self.mirror is not None:
                self.mirror.stop()
            if self.pool is not None:
                self.pool.close()

    def _loop(self) -> int:
        prev_rank: int | None = None
        while True:
            try:
                info = self.rdzv.next_rendezvous(prev_rank, self._abort_rendezvous, self._set_state)
            except RendezvousAborted:
                if self.leave.is_set():
                    return self._leave(None)
                if self.preemption.notice is not None:
                    return self._leave(None, cause="preemption")
                self._rejoin_as_new()
                prev_rank = None
                continue
            except JobEnded as ended:
                return self._finish(ended)
            prev_rank = info.rank
            outcome = self._run_round(info)
            if isinstance(outcome, JobEnded):
                return self._finish(outcome)
            if outcome == "leave":
                return self._leave(info)
            if outcome == "preempted":
                return self._leave(info, cause="preemption")
            if outcome == "lost":
                self._rejoin_as_new()
                prev_rank = None

    def _abort_rendezvous(self) -> bool:
        return self.leave.is_set() or self.heartbeat.lost.is_set() or self.preemption.notice is not None

    def _rejoin_as_new(self) -> None:
        """Our heartbeat expired (we were frozen): the others dropped us; come back as a new node."""
        self.events.emit("heartbeat.lost")
        self.heartbeat.register()

    # --- one round ---------------------------------------------------------------------------------
    def _run_round(self, info: RoundInfo) -> str | JobEnded:
        self.round = info
        self.round_steps = {}
        controlfiles.clear(self.control_dir, markers=True)
        workers = WorkerGroup(self.worker_spec, self.out, on_event=self._on_worker_event, pool=self.pool)
        workers.start(node_rank=info.rank, num_nodes=info.world_size, master_addr=info.master_addr,
                      master_port=info.master_port, restart_count=info.round - 1,
                      max_restarts=self.spec.max_restarts, run_id=self.spec.name,
                      extra_env=self._extra_env(info))
        self.events.emit("workers.started", round=info.round, rank=info.rank, world_size=info.world_size,
                         nproc=self.spec.nproc_per_node, warm=workers.warm_started,
                         warm_ready=workers.warm_ready)
        self._set_state("running")
        failed_at: float | None = None
        finishing_since: float | None = None
        failure = ""
        finished = False
        preempt_flagged = False
        last_snapshot = last_publish = last_snapshot_start = time.monotonic()
        self.progress["round_step_seen"] = False
        fail_grace = self.t.heartbeat_ttl + self.t.heartbeat_interval
        snap = self.rdzv.snapshot()
        while True:
            if self.leave.is_set():
                self._stop(workers, info, "agent asked to leave")
                return "leave"
            if self.heartbeat.lost.is_set():
                self._stop(workers, info, "heartbeat lost")
                return "lost"
            if self.preemption.notice is not None and not self.preemption.announced:
                self.preemption.announce(self._announce_preemption)
            woke = self.watcher.wait(0.1)
            now = time.monotonic()
            if woke or now - last_snapshot > 2.0:
                snap, last_snapshot = self.rdzv.snapshot(), now
                verdict = self._judge(snap, info)
                if verdict is not None:
                    self._stop(workers, info, verdict if isinstance(verdict, str) else "job ended")
                    return verdict
                preempt = (snap.round or {}).get("preempt")
                if preempt and not preempt_flagged:
                    preempt_flagged = True
                    controlfiles.write_preempt(self.control_dir, preempt["node_id"], preempt["deadline"])
                    self.events.emit("preemption.flagged", round=info.round, noticed=preempt["node_id"])
                    if preempt["node_id"] == self.node_id and not controlfiles.speaks_protocol(
                            self.control_dir, self.spec.nproc_per_node):
                        workers.signal_all(signal.SIGTERM)  # a plain torchrun script: do what torchrun does
            if self.preemption.announced and self.preemption.save_finished(workers, self.control_dir):
                self._stop(workers, info, "preemption checkpoint done")
                return "preempted"
            if not finished and not (snap.round or {}).get("preempt"):
                # All ranks of a data-parallel job end together: once one exited 0, a worker still
                # running after finish_grace is stuck at exit (seen in destroy_process_group once its
                # peers had gone). Stop it and count the node as done rather than hang the job forever.
                if finishing_since is None and (workers.some_succeeded() or snap.done.get(info.round)):
                    finishing_since = now
                if finishing_since is not None and now - finishing_since > self.t.finish_grace \
                        and workers.running:
                    self.events.emit("workers.lingered", round=info.round, seconds=self.t.finish_grace)
                    workers.stop(self.t.stop_grace)
                    finished = True
                    self.rdzv.mark_done(info.round)
                    self._set_state("succeeded")
            result = None if finished else workers.poll()
            if result is not None and not (snap.round or {}).get("preempt"):
                if result.succeeded:
                    finished = True
                    self.rdzv.mark_done(info.round)
                    self.events.emit("workers.succeeded", round=info.round)
                    self._set_state("succeeded")
                else:
                    if failed_at is None:
                        local_rank, code = result.first_failure() or (0, -1)
                        failure = (f"worker failure on {self.node_id} "
                                   f"(local rank {local_rank}, exit code {code})")
                        failed_at = now
                        self.events.emit("workers.failed", round=info.round, local_rank=local_rank, code=code)
                    # A peer that vanished makes our workers fail too; wait for its heartbeat to expire
                    # so membership changes are not counted as failures.
                    elif now - failed_at > fail_grace:
                        self.rdzv.start_round(self.rdzv.snapshot(), cause=failure, failure=True)
                        failed_at = now + 3600  # one attempt; the snapshot will show the new round
            if now - last_publish > PUBLISH_EVERY:
                last_publish = now
                self._publish()
            if (self.pool is not None and not self.pool.full
                    and (self.progress.get("round_step_seen") or now - last_snapshot_start > 10.0)):
                # After the first step: off the restart's critical path. One report per refill, never
                # one per loop pass (a pool that cannot fill starts nothing and reports nothing).
                if self.pool.fill():
                    threading.Thread(target=self._report_warm, args=(info.round,), daemon=True).start()

    def _report_warm(self, round_no: int) -> None:
        """One line when the refilled pool is ready: from then on a restart skips every import."""
        t0 = time.monotonic()
        pool = self.pool
        if pool is not None:
            ready = pool.wait_ready(WARM_WAIT)
            self.events.emit("workers.warm_ready", count=ready, round=round_no,
                             seconds=round(time.monotonic() - t0, 3))

    def _announce_preemption(self) -> bool:
        return self.rdzv.set_preempt(self.rdzv.snapshot(), self.preemption.notice.deadline)

    def _judge(self, snap: Snapshot, info: RoundInfo) -> str | JobEnded | None:
        """What the snapshot means for this round: None to keep going, else why it is over."""
        rnd = snap.round or {}
        if rnd.get("phase") == "final":
            return JobEnded(rnd)
        if int(rnd.get("round", 0)) != info.round:
            return "next round"
        alive = set(snap.nodes)
        done = snap.done.get(info.round, set())
        lost = sorted(n for n in info.ranks if n not in alive and n not in done)
        if lost:
            self.events.emit("membership.lost", round=info.round, nodes=lost)
            self.rdzv.start_round(snap, cause=f"node lost: {','.join(lost)}")
            return None
        waiting = sorted(alive - set(info.ranks))
        if waiting and len(info.ranks) < self.spec.max_size and self._is_lowest_live_rank(info, alive):
            self.events.emit("membership.waiting", round=info.round, nodes=waiting)
            self.rdzv.start_round(snap, cause=f"scale-up: {','.join(waiting)}")
            return None
        if done >= set(info.ranks):
            self.rdzv.end_job("succeeded", "all workers exited 0", info.round)
        return None

    def _is_lowest_live_rank(self, info: RoundInfo, alive: set[str]) -> bool:
        live_ranks = [r for n, r in info.ranks.items() if n in alive]
        return bool(live_ranks) and info.rank == min(live_ranks)

    def _stop(self, workers: WorkerGroup, info: RoundInfo, why: str) -> None:
        t0 = time.monotonic()
        self._set_state("stopping")
        codes = workers.stop(self.t.stop_grace)
        self.events.emit("workers.stopped", round=info.round, why=why, codes=codes,
                         seconds=round(time.monotonic() - t0, 3))
        span = self.round_steps
        # One line per round with its step span: enough for goodput (kept vs lost steps) later.
        self.events.emit("round.summary", round=info.round, rank=info.rank, world_size=info.world_size,
                         started=round(workers.started_at, 3), ended=round(time.time(), 3), why=why,
                         first_step=span.get("first"), last_step=span.get("last"),
                         first_step_ts=span.get("first_ts"), last_step_ts=span.get("last_ts"))

    def _extra_env(self, info: RoundInfo) -> dict[str, str]:
        return {"PETCTL_JOB": self.spec.name, "PETCTL_NODE_ID": self.node_id,
                "PETCTL_ROUND": str(info.round), "PETCTL_CHECKPOINT_URL": self.spec.checkpoint_url,
                "PETCTL_CONTROL_DIR": str(self.control_dir), "PETCTL_CACHE_DIR": str(self.work_dir / "cache")}

    # --- leaving -----------------------------------------------------------------------------------
    def _leave(self, info: RoundInfo | None, cause: str = "leave") -> int:
        """Graceful leave: heartbeat gone and the next round opened now, so nobody waits for a TTL."""
        self._set_state("leaving")
        # Open the next round first (it carries the real cause), then drop the heartbeat: its delete
        # event wakes the new round's closer, which then stops waiting for us.
        self.heartbeat.stop(delete=False)
        snap = self.rdzv.snapshot()
        rnd = snap.round or {}
        if rnd.get("phase") == "frozen" and self.node_id in (rnd.get("ranks") or {}):
            self.rdzv.start_round(snap, cause=f"{cause} of {self.node_id}")
        self.heartbeat.stop(delete=True)
        self.events.emit("agent.left", cause=cause, round=info.round if info else None)
        if cause == "preemption":
            self.preemption.complete_lifecycle()
            self.preemption.wait_for_termination(self.leave)
        return 0

    def _on_result(self, state: str, reason: str, round_no: int | None) -> None:
        """We wrote the job's final result: keep it beside the job's data, then release the capacity."""
        if self.mirror is not None:
            self.mirror.put_result({"job": self.spec.name, "state": state, "reason": reason,
                                    "round": round_no, "ts": time.time(), "node": self.node_id})
        if self.config.asg_name and not self.spec.keep:
            from petctl.agent.release import release_capacity

            # Releasing scales our own group to 0: say how the job ended before that can stop us.
            self._set_state(state)
            if self.mirror is not None:
                self.mirror.flush()
            release_capacity(self.config.asg_name, self.config.lifecycle_hook, self.config.region,
                             self.events)

    def _finish(self, ended: JobEnded) -> int:
        self.heartbeat.stop(delete=True)
        self._set_state(ended.state)
        self.events.emit("agent.exit", state=ended.state, reason=ended.reason)
        return 0 if ended.state in ("succeeded", "killed") else 1

    # --- status ------------------------------------------------------------------------------------
    def _on_worker_event(self, record: dict[str, Any]) -> None:
        """Follow the workers' progress lines (local rank 0 speaks for the node); no torch needed."""
        event = record.get("event")
        if int(record.get("local_rank", record.get("rank", 0)) or 0) % self.spec.nproc_per_node != 0:
            return
        if event == "train.step":
            step, ts = record.get("step"), record.get("ts")
            self.progress["step"] = step
            self.progress["round_step_seen"] = True
            span = self.round_steps
            if "first" not in span:
                span.update(first=step, first_ts=ts)
            span.update(last=step, last_ts=ts)
        elif event in ("checkpoint.saved", "checkpoint.loaded", "train.resumed"):
            if event == "checkpoint.saved":
                self.progress["last_checkpoint"] = {"step": record.get("step"), "url": record.get("url")}
            self.events.forward(record)

    def _set_state(self, state: str) -> None:
        self.state = state
        self._publish()

    def _publish(self) -> None:
        info = self.round if self.state not in ("joining", "waiting") else None
        value = {"node_id": self.node_id, "host_addr": self.config.host_addr, "pid": os.getpid(),
                 "state": self.state, "round": self.round.round if self.round else None,
                 "rank": info.rank if info else None, "world_size": info.world_size if info else None,
                 "restarts": info.restarts if info else None, "updated": time.time(),
                 "etcd_requests": self.stats.as_dict(),
                 "step": self.progress.get("step"), "last_checkpoint": self.progress.get("last_checkpoint")}
        if self.mirror is not None:
            self.mirror.set_status(value)
        try:
            self.client.write(self.keys.node_status(self.node_id), json.dumps(value), ttl=STATUS_TTL)
        except etcd.EtcdException:
            pass  # status is informational; never let it stop training
