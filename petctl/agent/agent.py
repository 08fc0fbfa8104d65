"""The elastic agent (`Agent`): its services, the rendezvous/round loop, leave and the job's end; with what
the agent does with the state it holds: a wiped store rebuilt, a finished job's capacity released.

Sections: the agent (this docstring); rebuilding a wiped store. The AWS calls (releasing capacity
included) are in autoscaling.py.

The elastic agent: one per instance, beside the workers. Never imports torch.

Loop: rendezvous (rendezvous.py) -> run the round (roundrunner.py) -> rendezvous again, until the job
ends, the agent is asked to leave, or its instance is preempted. Every decision is taken on a fresh etcd
view, so a missed watch event costs latency, never correctness. Why a global restart on every
membership change: collective libraries (gloo, NCCL) cannot shrink or grow a live process group, and a
peer that vanished leaves the others blocked in a collective; restarting every worker from the newest
checkpoint is the one robust answer, and it is what torchrun does.

The agent's services (event sink, mirror, preemption watcher, warm pool, heartbeat, `live/` watcher)
start inside one `ExitStack`, so whatever happens after one of them started (an early error included)
they all stop, and the mirror's final flush runs. A crash is reported as one `agent.crashed` event.

etcd is needed only to change membership: every etcd-facing service reports to one `StoreHealth`
(health.py), which reports an outage once and tells the decisions when membership can be trusted
again. An agent that starts while etcd is away waits for it; one whose etcd was replaced by an empty store
writes the job's state back (`rebuild_store`) from what it holds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO

from petctl.agent.autoscaling import instance_place, release_capacity
from petctl.agent.code import fetch_code
from petctl.agent.decisions import RoundInfo, Settings
from petctl.agent.health import OutageReporter, StoreHealth, describe, traceback_tail
from petctl.agent.leases import LeaseClasses
from petctl.agent.liveness import Heartbeat, PeerWatch, silence_limit, watching_enabled
from petctl.agent.notices import PreemptionHandler
from petctl.agent.rebalance import RebalanceResponder
from petctl.agent.rendezvous import EtcdRendezvous, JobEnded, LiveWatcher, RendezvousAborted, RequestStats
from petctl.agent.reporting import EtcdEventSink, Mirror, Progress, StatusPublisher
from petctl.agent.roundjudge import RoundOutcome
from petctl.agent.roundrunner import RoundParts, RoundRunner
from petctl.agent.snapshots import open_area
from petctl.agent.workers import OMP_THREADS, WorkerSpec, get_ready, torchrun_threads
from petctl.core.keys import JobKeys
from petctl.core.records import JobResult, NodeRecord, Phase, Round, WireFormatError
from petctl.core.spec import AgentConfig
from petctl.io import methodcache
from petctl.io.etcdpki import load_credentials
from petctl.io.eventlog import EventLog
from petctl.io.jobresult import record_result
from petctl.io.store import open_store, store_errors

# --- the agent ----------------------------------------------------------------------------------------------

STORE_MARGIN = 1.0  # beyond one TTL and one refresh: the others' heartbeats re-asserted after an outage
START_RETRY_MAX = 5.0  # the longest pause between two tries to reach etcd at start


class AgentCrashed(Exception):
    """The agent stopped on an unexpected error; `agent.crashed` has been emitted for it."""


class Agent:
    def __init__(self, config: AgentConfig, out: IO[str] | None = None, log_path: Path | None = None) -> None:
        self.config = config
        self.spec = spec = config.job
        self.out = out or sys.stdout
        self.node_id = config.node_id
        self.keys = JobKeys(spec.name)
        self.events = EventLog("agent", stream=self.out, job=spec.name, node=self.node_id)
        self.work_dir = Path(config.work_dir or os.getcwd())
        self.control_dir = self.work_dir / "control"
        self.settings = Settings.of(self.node_id, spec)
        self.stats = RequestStats()
        self.leave = threading.Event()
        t, endpoint, emit = spec.timeouts, spec.etcd_endpoint, self.events.emit
        ttl, interval = t.heartbeat_ttl, t.heartbeat_interval
        # A call etcd has not answered within a TTL is a failure (counted, reported) rather than a hang.
        timeout = min(5.0, max(1.0, ttl - interval))
        self.store = store = StoreHealth(emit, grace=ttl + interval + STORE_MARGIN,
                                         slow=max(ttl - interval, ttl / 2), straggle=timeout)
        tls = load_credentials(spec.etcd_credentials, self.work_dir / ".etcd-credentials", config.region)
        # One store for every service (safe across threads); its backend is the job's (JobSpec.etcd_store).
        self.kv = kv = open_store(endpoint, spec.etcd_store, tls, timeout)  # type: ignore[arg-type]
        self.leases = LeaseClasses(kv)
        self.watcher = LiveWatcher(kv, self.keys.live, self.stats,
                                   OutageReporter("watch", emit, parent=store))
        beat = NodeRecord(node_id=self.node_id, host_addr=config.host_addr, pid=os.getpid())
        self.heartbeat = Heartbeat(kv, self.keys, beat, interval, ttl,
                                   OutageReporter("heartbeat", emit, parent=store), store, self.events)
        self.peers = (PeerWatch(kv, self.keys, self.node_id, self.heartbeat, store,
                                OutageReporter("peers", emit, parent=store), self.events, silence_limit(t),
                                wake=self.watcher.nudge)
                      if watching_enabled(t) else None)
        self.rdzv = EtcdRendezvous(kv, self.leases, spec.name, self.node_id, config.host_addr, self.settings,
                                   self.events, self.watcher, self.stats, store)
        self.rdzv.on_result = self._on_result
        self.rdzv.on_own_key_missing = self.heartbeat.missing_from
        self.preemption = PreemptionHandler(config, self.events)
        self.preemption.wake = self.watcher.nudge
        self.preemption.on_rebalance = RebalanceResponder(self.control_dir, self.events)
        self.preemption.place = instance_place(config, self.events)
        self.event_sink = EtcdEventSink(self.leases, self.keys, self.node_id,
                                        OutageReporter("events", emit, parent=store))
        self.events.add_sink(self.event_sink)
        self.mirror = (Mirror(config.status_url, self.node_id, log_path, log=self.events)
                       if config.status_url else None)
        if self.mirror is not None:
            self.events.add_sink(self.mirror.add_event)
        self.progress = Progress(spec.nproc_per_node, self.events)
        self.preemption.progress = self.progress  # what a notice's hand-off plans with
        self.status = StatusPublisher(self.leases, self.keys, self.node_id, config.host_addr, self.stats,
                                      self.progress, OutageReporter("status", emit, parent=store),
                                      self.failures, self.mirror)

    def failures(self) -> dict[str, int]:
        """Failed attempts per service since the agent started (published in `NodeStatus.failures`)."""
        counts = {"watch": self.watcher.outage.failures, "heartbeat": self.heartbeat.outage.failures,
                  "events": self.event_sink.dropped, "status": self.status.outage.failures,
                  "records": self.rdzv.reader.corrupt_records, "sinks": self.events.sink_failures,
                  "rendezvous": self.rdzv.outage.failures, "store_outages": self.store.outages,
                  "launch_hook": self.preemption.launch_failures}
        if self.peers is not None:
            counts["peers"] = self.peers.outage.failures
        if self.mirror is not None:  # the mirror counts its own (petctl/agent/reporting.py)
            counts["mirror"] = self.mirror.failures
        return counts

    # --- lifecycle ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends or the node leaves; the exit code (0: succeeded, killed or left).
        Raises AgentCrashed (after emitting `agent.crashed`) on any unexpected error."""
        signal.signal(signal.SIGTERM, lambda *_: self.leave.set())
        signal.signal(signal.SIGINT, lambda *_: self.leave.set())
        with contextlib.ExitStack() as services:
            try:
                return self._run(services)
            except Exception as e:  # noqa: BLE001 - the last line of defence: reported while the sinks run
                self.events.emit("agent.crashed", error=describe(e), traceback=traceback_tail(e))
                raise AgentCrashed(describe(e)) from e

    def _run(self, services: contextlib.ExitStack) -> int:
        services.callback(self.kv.close)  # last: every service above stops before the store closes
        self.event_sink.start()
        services.callback(self.event_sink.stop)
        if self.mirror is not None:
            self.mirror.start()
            services.callback(self.mirror.stop)  # its final flush
        self.preemption.start()
        services.callback(self.preemption.stop)
        # cpu_s: what the interpreter's start, the imports and the set-up so far cost this process (bench
        # P5 splits an agent's CPU to its first rank at this line); method_cache: what the dataclass method
        # cache saved of the imports, and a bad cache file, once (petctl/io/methodcache.py). Every module
        # a start needs is imported by now, the store's backend too: what they compiled is kept here.
        methodcache.save()
        cache = methodcache.state()
        self.events.emit("agent.started", host=self.config.host_addr, pid=os.getpid(), min=self.spec.min_size,
                         max=self.spec.max_size, nproc=self.spec.nproc_per_node, **self.preemption.identity(),
                         cpu_s=round(time.process_time(), 3), **({"method_cache": cache} if cache else {}))
        worker_spec = self._worker_spec()
        snapshot_dir = open_area(self.spec.name, self.node_id, self.events, services)
        pool = get_ready(self.spec, worker_spec, self.work_dir, self.events, self.out, services)
        if not self._until_store_answers(self.heartbeat.start):
            return self._leave(None)
        self.preemption.registered()  # our heartbeat is in etcd: the boot worked (the launch hook)
        services.callback(self.heartbeat.stop, delete=True)  # a no-op after a leave or the job's end
        self.watcher.start(after=self.heartbeat.revision, membership=False)  # the rendezvous resumes it
        services.callback(self.watcher.stop)
        if self.peers is not None:
            self.peers.start()
            services.callback(self.peers.stop)
        runner = RoundRunner(RoundParts(
            spec=self.spec, node_id=self.node_id, settings=self.settings, events=self.events, rdzv=self.rdzv,
            watcher=self.watcher, heartbeat=self.heartbeat, peers=self.peers, preemption=self.preemption,
            status=self.status, progress=self.progress, leave=self.leave, control_dir=self.control_dir,
            work_dir=self.work_dir, out=self.out, worker_spec=worker_spec, pool=pool,
            rebuild=StoreRebuilder(self.rdzv, self.mirror, self.spec.to_json(), self.events).rebuild,
            depart=self._depart, snapshot_dir=snapshot_dir))
        return self._loop(runner)

    def _worker_spec(self) -> WorkerSpec:
        code_dir = self.work_dir / "code"
        if self.spec.code_url:
            fetch_code(self.spec.code_url, code_dir)
        else:
            code_dir = self.work_dir
        threads = torchrun_threads(self.spec.nproc_per_node, os.environ, self.spec.env)
        if threads:
            self.events.emit("workers.threads", omp_num_threads=int(threads[OMP_THREADS]),
                             reason="torchrun's default for more than one worker per node")
        spec = WorkerSpec(cmd=[sys.executable, "-u", self.spec.entrypoint, *self.spec.args],
                          cwd=str(code_dir), nproc=self.spec.nproc_per_node,
                          base_env={**threads, **self.spec.env})
        spec.preload += tuple(self.spec.warm_imports)
        return spec

    def _loop(self, runner: RoundRunner) -> int:
        prev_rank: int | None = None
        abort = self._abort_rendezvous
        while True:
            try:
                info = self.rdzv.next_rendezvous(prev_rank, abort, self.status.set_state)
            except RendezvousAborted:
                if self.preemption.notice is not None and not self.preemption.leaving:
                    return self._leave(None, cause="preemption")
                return self._leave(None)
            except JobEnded as ended:
                return self._finish(ended)
            prev_rank = info.rank
            outcome = runner.run(info)
            if outcome is RoundOutcome.LEAVE:
                return self._leave(info)
            if outcome is RoundOutcome.PREEMPTED:
                return self._leave(info, cause="preemption")
            # JOB_ENDED: the rendezvous reads the final round and raises JobEnded, whatever the flags say.
            abort = self._abort_rendezvous if outcome is not RoundOutcome.JOB_ENDED else (lambda: False)

    def _abort_rendezvous(self) -> bool:
        return self.leave.is_set() or self.preemption.notice is not None

    def _until_store_answers(self, call) -> bool:
        """Run `call` (an etcd write) until etcd (maybe being replaced) answers, with backoff; False if
        the agent was asked to leave meanwhile."""
        pause = 0.5
        while not self.leave.is_set():
            try:
                call()
                self.store.succeeded(service="start")
                return True
            except store_errors() as e:
                self.store.failed(e, "start")
            self.leave.wait(pause)
            pause = min(2 * pause, START_RETRY_MAX)
        return False

    # --- leaving -----------------------------------------------------------------------------------
    def _depart(self, cause: str) -> None:
        """Out of the job in etcd: the next round opened (with the real cause), then our heartbeat deleted
        (waking its closer). The round runner calls it once our save is done; `_leave` again (a no-op)."""
        self.status.set_state("leaving")
        if self.heartbeat.deleted:
            return
        self.heartbeat.stop(delete=False)
        try:
            view = self.rdzv.view()
            rnd = view.round
            if rnd is not None and rnd.phase is Phase.FROZEN and self.node_id in rnd.ranks:
                self.rdzv.start_round(view, cause=f"{cause} of {self.node_id}", leaving=self.node_id)
        except store_errors() as e:  # the others see our heartbeat expire instead
            self.store.failed(e, "leave")
        self.heartbeat.stop(delete=True)

    def _leave(self, info: RoundInfo | None, cause: str = "leave") -> int:
        """Graceful leave: heartbeat gone and the next round opened now, so nobody waits for a TTL."""
        self._depart(cause)
        self.events.emit("agent.left", cause=cause, round=info.round if info else None)
        if cause == "preemption":
            self.preemption.complete_lifecycle()
            if not self.preemption.end_instance():  # not detached: the reclaim ends the instance
                self.preemption.wait_for_termination(self.leave)
        return 0

    def _on_result(self, result: JobResult) -> None:
        """We wrote the job's final result: keep it beside the job's data, then release the capacity."""
        if self.mirror is not None:
            self.mirror.put_result(result.to_dict())
        if self.config.asg_name and not self.spec.keep:

            # Releasing scales our own group to 0: say how the job ended before that can stop us.
            self.status.set_state(result.state)
            if self.mirror is not None:
                self.mirror.flush()
            release_capacity(self.config.asg_name, self.config.lifecycle_hook, self.config.region,
                             self.events)

    def _finish(self, ended: JobEnded) -> int:
        self.heartbeat.stop(delete=True)
        self.status.set_state(ended.state)
        self.events.emit("agent.exit", state=ended.state, reason=ended.reason,
                         cpu_s=round(time.process_time(), 3))  # this process's CPU since its launch
        return 0 if ended.state in ("succeeded", "killed") else 1


# --- rebuilding a wiped store -------------------------------------------------------------------------------
# Writing a job's state back into an etcd that lost it: what replacing the etcd host does.
#
# On AWS the etcd host keeps its fixed address when it is replaced, but not its data: the agents find an
# empty store where their job was. Each of them holds what matters (the spec, the round it runs in with its
# ranks and restart count), so the first to notice writes it back, and the job carries on in the same round
# with no restart (the heartbeats are re-asserted by liveness.py; membership is not judged until they are:
# health.py). Every write is create-only (`prevExist=False`): several agents may rebuild at once, and
# the first one wins.
#
# A job that had already ended must stay ended: its result is also stored in the job's prefix (the mirror),
# so it is read back from there and recorded again, instead of the round being rebuilt.

class StoreRebuilder:
    def __init__(self, rdzv: EtcdRendezvous, mirror: Mirror | None, spec_json: str, events: EventLog) -> None:
        self.rdzv = rdzv
        self.mirror = mirror
        self.spec_json = spec_json
        self.events = events

    def rebuild(self, rnd: Round) -> None:
        """etcd answers but holds no round while we run `rnd`: write back the result if the job ended,
        else `rnd` and the spec. Raises one of `io.store.store_errors()` if etcd fails (the round runner
        retries on its next look)."""
        prior = self._stored_result()
        if prior is not None:
            if record_result(self.rdzv.kv, prior):
                self.events.emit("store.rebuilt", result=prior.state, round=prior.round)
            return
        if self.rdzv.create_round(rnd):
            self.events.emit("store.rebuilt", round=rnd.round, phase=rnd.phase.value, restarts=rnd.restarts)
        self.rdzv.kv.create(self.rdzv.keys.spec, self.spec_json)  # False: another agent put it back first

    def _stored_result(self) -> JobResult | None:
        if self.mirror is None:
            return None
        try:
            return self.mirror.read_result()
        except (OSError, WireFormatError) as e:  # unreadable: rebuilding the round is still the right call
            self.events.emit("store.result_unreadable", error=describe(e))
            return None
