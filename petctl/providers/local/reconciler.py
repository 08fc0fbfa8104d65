"""The local provider's Auto Scaling group: keeps a job's desired number of instances alive.

Run detached by `run_job` as `python -m petctl.providers.local.reconciler --job-dir DIR`, one per job.
Like an ASG it knows nothing about ranks or rounds beyond choosing scale-in victims: it launches agents,
replaces the ones that die, SIGTERMs the surplus on scale-in, and turns a preemption notice whose time has
come into a SIGKILL of the instance's process group (AWS reclaiming a spot instance). A rebalance
recommendation is answered as Capacity Rebalancing does (rebalance.py): replacement first, then the
at-risk instance's scale-in notice. The job ends when the etcd `result` key appears (written by an agent,
or by `kill_job`); SIGTERM to the reconciler ends it as killed. Either way every instance is stopped
before the reconciler exits: it never leaves orphans.

Boot, billed: a replacement (for a lost instance, a detached one, or one with a rebalance recommendation)
is launched at once, billed from then, and its agent starts `replace_delay` seconds later: the simulated
boot of a real instance (AMI start, setup). A booting instance counts toward the group's size, so it is
never launched twice. The job's first instances and `petctl scale` ups start their agents at once.

Detach (the local DetachInstances without decrementing the desired capacity): an agent POSTs
`latest/petctl/detach` to its own metadata endpoint (metadata_server.py); at the next tick the instance
stops counting toward the desired size and a replacement is launched at once. The detached instance runs
on until it exits by itself (no replacement for that: it is not a loss) or its notice's reclaim time.
Replacements respect the over-max allowance of rebalance.py: the group may exceed its max by
`over_max_allowance(desired)` instances, detached ones included, and a replacement beyond that waits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from petctl.core.records import JobResult
from petctl.core.spec import JobSpec
from petctl.io.eventlog import EventLog
from petctl.providers.local import instances as inst_mod
from petctl.providers.local.fleet import Fleet
from petctl.providers.local.instances import Instance
from petctl.providers.local.jobdir import JobDir
from petctl.providers.local.joblink import JobLink
from petctl.providers.local.rebalance import CapacityRebalancer, over_max_allowance, with_replaced

QUICK_EXIT_S = 10.0  # an instance that fails faster than this after launch is crash-looping
MAX_QUICK_FAILURES = 5  # ... and this many in a row end the job (a broken agent, not bad luck)
SELF_EXIT_GRACE_S = 3.0  # once the job is over, agents get this long to exit by themselves


@dataclass
class Options:
    job_dir: Path
    etcd_endpoint: str
    replace_delay: float = 3.0
    poll: float = 0.25


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Launches:
    """What one tick launches: replacements (each boots `replace_delay`) and fresh instances (at once)."""

    replacements: list[str]  # the instances replaced, one launch each, oldest first
    fresh: int  # the job's start or a scale-up: agents started at once
    owed: list[str]  # replacements still owed, waiting for room over the max


def plan_launches(counted: int, desired: int, owed: list[str], live_total: int, max_size: int) -> Launches:
    """The launches that bring the group back to `desired`.

    `counted`: live instances that count toward desired (booting ones included; detached ones and those
    a rebalance replacement stands for excluded). `owed`: instances lost or detached whose replacement is
    not launched yet, oldest first; only as many as the group is short are kept (a scale-in meanwhile
    makes them unnecessary). `live_total`: every live instance, detached ones included: a replacement
    may take the group over its max by `over_max_allowance(desired)`, no further; beyond, it waits."""
    deficit = max(0, desired - counted)
    owed = owed[:deficit]
    room = max(0, max_size + over_max_allowance(desired) - live_total)
    now = owed[:room]
    return Launches(replacements=now, fresh=deficit - len(owed), owed=owed[len(now):])


def start_metadata_server(notices: Path, on_detach=None, on_end=None):
    """The local instance metadata endpoint (spot notices, detach, end), when that module is available."""
    try:
        from petctl.providers.local.metadata_server import LocalMetadataServer
    except ImportError:
        return None
    notices.mkdir(parents=True, exist_ok=True)
    server = LocalMetadataServer(notices, on_detach=on_detach, on_end=on_end)
    server.start()
    return server


class Reconciler:
    """The job's desired instance count kept alive, and every instance stopped when the job ends."""

    def __init__(self, opts: Options, spec: JobSpec, events: EventLog, command: list[str] | None = None):
        from petctl.io.etcdpki import load_credentials
        from petctl.io.store import open_store

        self.opts = opts
        self.job = JobDir(opts.job_dir)
        self.spec = spec
        self.events = events
        # The job's own etcd user (the reconciler only reads and ends this job), not the provider's root.
        tls = load_credentials(spec.etcd_credentials, opts.job_dir / "etcd")
        store = open_store(opts.etcd_endpoint, spec.etcd_store, tls, timeout=2.0)  # type: ignore[arg-type]
        self.link = JobLink(store, spec.name, events)
        self.fleet = Fleet(self.job, spec, events, command, stop_grace=spec.timeouts.stop_grace + 5.0)
        self.reclaimed: dict[str, str] = {}  # instance -> reason, for notices we enforced
        self.owed: list[str] = []  # lost or detached instances whose replacement is not launched yet
        self._detach_lock = threading.Lock()
        self._detach_requests: list[str] = []  # from the metadata endpoint's thread, taken at each tick
        self._end_requests: dict[str, float] = {}  # the same: instance -> when it asked to end
        self.desired = spec.size
        self.quick_failures = 0
        self.failure = ""  # why the reconciler itself ends the job as failed ("" while it does not)
        self.stop_requested = False
        self.metadata = None
        self.rebalancer = CapacityRebalancer(
            self.job, events, spec.max_size,
            lambda at_risk: self._launch(boot_s=self.opts.replace_delay, replaces=at_risk),
            self.link.ranks, self.link.alive)

    # --- the loop --------------------------------------------------------------------------------
    def run(self) -> JobResult:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        try:
            self.metadata = start_metadata_server(self.job.notices, on_detach=self.request_detach,
                                                  on_end=self.request_end)
        except OSError as e:  # no spot notices then, but the job itself can still run
            self.events.emit("reconciler.imds_unavailable", error=str(e))
        self.events.emit("reconciler.started", pid=os.getpid(), desired=self.desired,
                         imds=bool(self.metadata))
        result: JobResult | None = None
        try:
            while True:
                result = self.link.result()
                if result or self.stop_requested:
                    break
                self.tick(time.time())
                time.sleep(self.opts.poll)
        except Exception as e:  # noqa: BLE001 - a bug or a broken disk: end the job loudly, never orphan it
            self.failure = f"the reconciler failed: {type(e).__name__}: {e}"
            self.events.emit("reconciler.error", error=self.failure, traceback=traceback.format_exc())
        finally:
            result = self.shutdown(result)
            self.link.store.close()
        return result

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    def tick(self, now: float) -> None:
        self.take_detaches(now)
        self.take_ends(now)
        self.reap(now)
        self.fleet.boot(now)
        self.enforce_notices(now)
        self.rebalancer.tick(self.fleet.live(), self.desired, now)
        self.scale(now)
        self.fleet.escalate(now)
        self.fleet.refresh_frozen()
        self.fleet.persist()

    # --- detach ----------------------------------------------------------------------------------
    def request_detach(self, iid: str) -> bool:
        """The metadata endpoint's callback (its own thread): detach `iid` at the next tick. True when
        the instance is ours and live, or detached already (the call is idempotent)."""
        inst = self.fleet.instances.get(iid)
        if inst is None or not (inst.live or inst.detached):
            return False
        with self._detach_lock:
            if not inst.detached and iid not in self._detach_requests:
                self._detach_requests.append(iid)
        return True

    def take_detaches(self, now: float) -> None:
        """Detach what was asked for: it stops counting toward desired, and its replacement is owed."""
        with self._detach_lock:
            asked, self._detach_requests = self._detach_requests, []
        for iid in asked:
            inst = self.fleet.instances.get(iid)
            if inst is None or inst.detached or not inst.live:
                continue
            inst.detached_at = now
            self.owed.append(iid)
            self.events.emit("instance.detached", instance=iid, desired=self.desired)

    # --- end: a detached instance ends itself (the local power-off) -----------------------------------
    def request_end(self, iid: str) -> bool:
        """The metadata endpoint's callback (its own thread): end the detached instance `iid` at the next
        tick, billed until now. True when it is ours and detached (or its detach is asked for), live or
        ended already (idempotent); False for one still in the group: as on AWS, the group ends that one."""
        inst = self.fleet.instances.get(iid)
        with self._detach_lock:  # a detach asked for is taken before the end, at the same tick
            if inst is None or not (inst.detached or iid in self._detach_requests):
                return False
            self._end_requests.setdefault(iid, time.time())
        return True

    def take_ends(self, now: float) -> None:
        """End what asked to end: billed until the request (EC2 stops billing once an instance is
        shutting down), its agent stopped as a host's power-off stops it. Taken before the reclaims are
        enforced, so an instance that asked before its reclaim time is not reclaimed."""
        with self._detach_lock:
            asked, self._end_requests = self._end_requests, {}
        for iid, at in asked.items():
            inst = self.fleet.instances.get(iid)
            if inst is not None and inst.live:  # asked with its detach pending: not before that is taken
                at = max(at, inst.detached_at or at)
                self.fleet.power_off(inst, "detached, then ended by its agent", at, now)

    def reap(self, now: float) -> None:
        for inst, code in self.fleet.exited():
            if inst.shutdown_at is not None:  # it asked to end: its reason and billing were set then
                pass
            elif inst.detached:  # it ends itself after leaving (or is reclaimed): not a loss
                inst.reason = f"detached, then {self.reclaimed.get(inst.id) or _describe_exit(code)}"
            elif inst.state != "terminating":
                inst.reason = self._loss_reason(inst, code)
                self.owed.append(inst.id)
                self._count_quick_failure(inst, code, now)
            self.fleet.ended(inst, code, now)

    def _loss_reason(self, inst: Instance, code: int) -> str:
        if inst.id in self.reclaimed:
            return self.reclaimed[inst.id]
        try:
            chaos = self.job.chaos_marker(inst.id).read_text().strip()
        except OSError:
            chaos = ""  # no marker: nobody took it away on purpose
        return f"chaos-{chaos}: {_describe_exit(code)}" if chaos else _describe_exit(code)

    def _count_quick_failure(self, inst: Instance, code: int, now: float) -> None:
        deliberate = inst.id in self.reclaimed or self.job.chaos_marker(inst.id).exists()
        started = inst.booted_at if inst.booted_at is not None else inst.launched_at
        if code != 0 and not deliberate and now - started < QUICK_EXIT_S:
            self.quick_failures += 1
        else:
            self.quick_failures = 0
        if self.quick_failures >= MAX_QUICK_FAILURES:
            reason = (f"{self.quick_failures} instances in a row exited within {QUICK_EXIT_S:.0f}s of "
                      f"launch ({_describe_exit(code)}): see `petctl logs {self.spec.name}`")
            if not self.link.end("failed", reason):  # etcd refused: end it ourselves, as failed
                self.failure = reason
                self.stop_requested = True

    def enforce_notices(self, now: float) -> None:
        for inst in self.fleet.live():
            notice = self.job.read_notice(inst.id)
            kind = str((notice or {}).get("kind", "spot"))
            if not notice or kind == "rebalance" or inst.id in self.reclaimed or float(notice["time"]) > now \
                    or not inst.has_process:
                continue
            self.reclaimed[inst.id] = f"{kind}-reclaimed"
            self.events.emit("instance.reclaimed", instance=inst.id, kind=kind)
            inst.ref.signal_group(signal.SIGKILL)

    def scale(self, now: float) -> None:
        desired = self.job.read_desired(default=self.desired)
        if desired != self.desired:
            self.events.emit("scale.changed", previous=self.desired, desired=desired)
            self.desired = desired
        every = self.fleet.live()
        leaving = self.rebalancer.leaving(every)  # replaced already: the replacement counts instead
        live = [i for i in every if i.id not in leaving and not i.detached]
        if len(live) > desired:
            self.owed.clear()
            chosen = [i.id for i in self._victims(live, len(live) - desired)]
            by_id = {i.id: i for i in every}
            for victim in with_replaced(chosen, self.rebalancer.replaced_by(every)):
                self.fleet.terminate(by_id[victim], "scale-in", now)
            return
        todo = plan_launches(len(live), desired, self.owed, len(every), self.spec.max_size)
        if now < self.job.capacity_hold():
            self.owed = todo.replacements + todo.owed
            return
        self.owed = todo.owed
        for replaced in todo.replacements:
            if self._launch(boot_s=self.opts.replace_delay, replaces=replaced) is None:
                return
        for _ in range(todo.fresh):
            if self._launch() is None:
                return

    def _launch(self, boot_s: float = 0.0, replaces: str = "") -> Instance | None:
        """One new instance with its metadata endpoint, billed from now, its agent started after `boot_s`;
        None when the job has ended meanwhile."""
        if self.link.result():  # the agents may have ended the job between our checks
            return None
        iid = inst_mod.new_instance_id()
        imds = self.metadata.endpoint_for(iid) if self.metadata else ""
        return self.fleet.launch(imds, iid, self.desired, boot_s=boot_s, replaces=replaces)

    def _victims(self, live: list[Instance], count: int) -> list[Instance]:
        """Instances without a rank first (newest first), then the highest ranks: rank 0 stays."""
        ranks = self.link.ranks()
        return sorted(live, key=lambda i: (i.id in ranks, -ranks.get(i.id, 0), -i.launched_at))[:count]

    # --- the end ---------------------------------------------------------------------------------
    def shutdown(self, result: JobResult | None) -> JobResult:
        """Stop every instance (the job is over, we were told to go, or we failed), record why."""
        if result is None:
            state, reason = ("failed", self.failure) if self.failure else ("killed", "the job was killed")
            self.link.end(state, reason)
            result = self.link.result() or JobResult(state=state, reason=reason, ts=time.time())
        self.events.emit("reconciler.stopping", state=result.state, reason=result.reason)
        self.fleet.stop_all(result.state, SELF_EXIT_GRACE_S, hurry=lambda: self.stop_requested)
        if self.metadata is not None:
            try:
                self.metadata.stop()
            except OSError as e:  # the job is over either way; say why the endpoint did not stop cleanly
                self.events.emit("reconciler.imds_stop_failed", error=str(e))
        self.job.update_meta(state=result.state, reason=result.reason, finished_at=time.time())
        self.events.emit("reconciler.exit", state=result.state)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--etcd", required=True, help="etcd endpoint, http://host:port")
    parser.add_argument("--replace-delay", type=float, default=3.0,
                        help="how long a replacement boots before its agent starts; billed from launch")
    args = parser.parse_args(argv)
    job = JobDir(args.job_dir)
    meta = job.read_meta()
    spec = JobSpec.from_dict(meta["spec"])
    events = EventLog("reconciler", stream=sys.stdout, job=spec.name)
    opts = Options(job_dir=args.job_dir, etcd_endpoint=args.etcd, replace_delay=args.replace_delay)
    Reconciler(opts, spec, events, command=meta.get("agent_command")).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
