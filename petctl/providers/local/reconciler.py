"""The local provider's Auto Scaling group: keeps a job's desired number of instances alive.

Run detached by `run_job` as `python -m petctl.providers.local.reconciler --job-dir DIR`, one per job.
Like an ASG it knows nothing about ranks or rounds beyond choosing scale-in victims: it launches agents,
replaces the ones that die (after `replace_delay`, so the shrunken world is observable before the
replacement joins), SIGTERMs the surplus on scale-in, and turns a preemption notice whose time has come
into a SIGKILL of the instance's process group (AWS reclaiming a spot instance). The job ends when the
etcd `result` key appears (written by an agent, or by `kill_job`); SIGTERM to the reconciler ends it as
killed. Either way every instance is stopped before the reconciler exits: it never leaves orphans.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl.core.eventlog import EventLog
from petctl.core.keys import JobKeys
from petctl.core.spec import JobSpec
from petctl.providers.local import instances as inst_mod
from petctl.providers.local.instances import Instance
from petctl.providers.local.jobdir import JobDir

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


def start_metadata_server(notices: Path):
    """The local instance metadata endpoint (spot notices), when that module is available."""
    try:
        from petctl.providers.local.metadata_server import LocalMetadataServer
    except ImportError:
        return None
    notices.mkdir(parents=True, exist_ok=True)
    server = LocalMetadataServer(notices)
    server.start()
    return server


class Reconciler:
    def __init__(self, opts: Options, spec: JobSpec, events: EventLog, command: list[str] | None = None):
        from petctl.io.etcd import etcd_client

        self.opts = opts
        self.job = JobDir(opts.job_dir)
        self.spec = spec
        self.keys = JobKeys(spec.name)
        self.events = events
        self.command = command
        self.client = etcd_client(opts.etcd_endpoint, read_timeout=2.0)
        self.instances: dict[str, Instance] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.deadlines: dict[str, float] = {}  # terminating instance -> when to SIGKILL its group
        self.reclaimed: dict[str, str] = {}  # instance -> reason, for notices we enforced
        self.not_before = 0.0  # no launch before this (replacement delay after a loss)
        self.desired = spec.size
        self.quick_failures = 0
        self.stop_requested = False
        self.metadata = None
        self._etcd_down = False
        self._written: list[dict[str, Any]] | None = None
        self.stop_grace = spec.timeouts.stop_grace + 5.0

    # --- etcd ------------------------------------------------------------------------------------
    def result(self) -> dict[str, Any] | None:
        import etcd

        try:
            value = self.client.read(self.keys.result).value
        except etcd.EtcdKeyNotFound:
            return None
        except Exception as e:  # etcd down or slow: keep the instances as they are, say so once
            if not self._etcd_down:
                self.events.emit("reconciler.etcd_unreachable", error=str(e))
            self._etcd_down = True
            return None
        self._etcd_down = False
        try:
            return json.loads(value)
        except ValueError:
            return {"state": "unknown", "reason": value}

    def ranks(self) -> dict[str, int]:
        try:
            data = json.loads(self.client.read(self.keys.round).value)
        except Exception:
            return {}
        if not isinstance(data, dict) or data.get("phase") != "frozen":
            return {}
        return {k: int(v) for k, v in (data.get("ranks") or {}).items()}

    # --- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        try:
            self.metadata = start_metadata_server(self.job.notices)
        except OSError as e:  # no spot notices then, but the job itself can still run
            self.events.emit("reconciler.imds_unavailable", error=str(e))
        self.events.emit("reconciler.started", pid=os.getpid(), desired=self.desired,
                         imds=bool(self.metadata))
        result: dict[str, Any] | None = None
        failure = ""
        try:
            while True:
                result = self.result()
                if result or self.stop_requested:
                    break
                self.tick(time.time())
                time.sleep(self.opts.poll)
        except Exception as e:  # a bug or a broken disk: end the job loudly rather than orphan it
            failure = f"the reconciler failed: {type(e).__name__}: {e}"
            self.events.emit("reconciler.error", error=failure, traceback=traceback.format_exc())
        finally:
            result = self.shutdown(result, failure)
        return result

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    def tick(self, now: float) -> None:
        self.reap(now)
        self.enforce_notices(now)
        self.scale(now)
        self.escalate(now)
        self.refresh_frozen()
        self.persist()

    def live(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.live]

    def reap(self, now: float) -> None:
        for iid, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            inst = self.instances[iid]
            inst.ref.signal_group(signal.SIGKILL)  # workers that outlived their agent go with it
            del self.procs[iid]
            self.deadlines.pop(iid, None)
            if inst.state != "terminating":
                inst.reason = self._loss_reason(inst, code)
                self.not_before = max(self.not_before, now + self.opts.replace_delay)
                self._count_quick_failure(inst, code, now)
            inst.state, inst.ended_at, inst.returncode = "terminated", now, code
            self.events.emit("instance.terminated", instance=iid, reason=inst.reason, returncode=code)

    def _loss_reason(self, inst: Instance, code: int) -> str:
        if inst.id in self.reclaimed:
            return self.reclaimed[inst.id]
        try:
            chaos = self.job.chaos_marker(inst.id).read_text().strip()
        except OSError:
            chaos = ""
        return f"chaos-{chaos}: {_describe_exit(code)}" if chaos else _describe_exit(code)

    def _count_quick_failure(self, inst: Instance, code: int, now: float) -> None:
        deliberate = inst.id in self.reclaimed or self.job.chaos_marker(inst.id).exists()
        if code != 0 and not deliberate and now - inst.launched_at < QUICK_EXIT_S:
            self.quick_failures += 1
        else:
            self.quick_failures = 0
        if self.quick_failures >= MAX_QUICK_FAILURES:
            from petctl.io.jobresult import write_result

            reason = (f"{self.quick_failures} instances in a row exited within {QUICK_EXIT_S:.0f}s of "
                      f"launch ({_describe_exit(code)}): see `petctl logs {self.spec.name}`")
            try:
                write_result(self.client, self.spec.name, "failed", reason)
            except Exception:
                self.stop_requested = True

    def enforce_notices(self, now: float) -> None:
        for inst in self.live():
            notice = self.job.read_notice(inst.id)
            if not notice or inst.id in self.reclaimed or float(notice["time"]) > now:
                continue
            kind = str(notice.get("kind", "spot"))
            self.reclaimed[inst.id] = f"{kind}-reclaimed"
            self.events.emit("instance.reclaimed", instance=inst.id, kind=kind)
            inst.ref.signal_group(signal.SIGKILL)

    def scale(self, now: float) -> None:
        desired = self.job.read_desired(default=self.desired)
        if desired != self.desired:
            self.events.emit("scale.changed", previous=self.desired, desired=desired)
            self.desired = desired
        live = self.live()
        if len(live) > desired:
            for victim in self._victims(live, len(live) - desired):
                self._terminate(victim, "scale-in", now)
        elif len(live) < desired and now >= self.not_before:
            if self.result():  # the agents may have ended the job between our checks
                return
            for _ in range(desired - len(live)):
                self._launch()

    def _victims(self, live: list[Instance], count: int) -> list[Instance]:
        """Instances without a rank first (newest first), then the highest ranks: rank 0 stays."""
        ranks = self.ranks()
        return sorted(live, key=lambda i: (i.id in ranks, -ranks.get(i.id, 0), -i.launched_at))[:count]

    def _launch(self) -> None:
        iid = inst_mod.new_instance_id()
        imds = self.metadata.endpoint_for(iid) if self.metadata else ""
        inst, proc = inst_mod.launch(self.job, self.spec, iid=iid, imds_endpoint=imds, command=self.command)
        self.instances[inst.id] = inst
        self.procs[inst.id] = proc
        self.events.emit("instance.launched", instance=inst.id, pid=inst.pid, desired=self.desired)

    def _terminate(self, inst: Instance, reason: str, now: float) -> None:
        inst.state, inst.reason = "terminating", reason
        self.deadlines[inst.id] = now + self.stop_grace
        inst.ref.signal_group(signal.SIGCONT)
        inst.ref.signal(signal.SIGTERM)
        self.events.emit("instance.terminating", instance=inst.id, reason=reason)

    def escalate(self, now: float) -> None:
        for iid, deadline in list(self.deadlines.items()):
            if now >= deadline:
                self.instances[iid].ref.signal_group(signal.SIGKILL)
                del self.deadlines[iid]

    def refresh_frozen(self) -> None:
        for inst in self.live():
            state = "frozen" if inst.ref.frozen() else "running"
            if state != inst.state:
                inst.state = state
                self.events.emit(f"instance.{'frozen' if state == 'frozen' else 'thawed'}", instance=inst.id)

    def persist(self) -> None:
        rows = [i.to_dict() for i in self.instances.values()]
        if rows != self._written:
            self.job.write_instances(rows)
            self._written = rows

    # --- the end ---------------------------------------------------------------------------------
    def shutdown(self, result: dict[str, Any] | None, failure: str = "") -> dict[str, Any]:
        """Stop every instance (the job is over, we were told to go, or we failed), record why."""
        from petctl.io.jobresult import write_result

        if result is None:
            state, reason = ("failed", failure) if failure else ("killed", "the job was killed")
            try:
                write_result(self.client, self.spec.name, state, reason)
            except Exception:
                pass
            result = self.result() or {"state": state, "reason": reason}
        self.events.emit("reconciler.stopping", state=result.get("state"), reason=result.get("reason"))
        deadline = time.monotonic() + SELF_EXIT_GRACE_S
        while self.procs and time.monotonic() < deadline and not self.stop_requested:
            if all(p.poll() is not None for p in self.procs.values()):
                break
            time.sleep(0.1)
        for iid, proc in self.procs.items():
            if proc.poll() is None:
                self.instances[iid].ref.signal_group(signal.SIGCONT)
                self.instances[iid].ref.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.1)
        now = time.time()
        for iid, proc in self.procs.items():
            inst = self.instances[iid]
            inst.ref.signal_group(signal.SIGKILL)
            code = proc.wait()
            inst.state, inst.ended_at, inst.returncode = "terminated", now, code
            inst.reason = inst.reason if inst.reason == "scale-in" else f"job {result.get('state')}"
            self.events.emit("instance.terminated", instance=iid, reason=inst.reason, returncode=code)
        self.procs.clear()
        self.persist()
        if self.metadata is not None:
            try:
                self.metadata.stop()
            except Exception:
                pass
        self.job.update_meta(state=result.get("state", "unknown"), reason=result.get("reason", ""),
                             finished_at=time.time())
        self.events.emit("reconciler.exit", state=result.get("state"))
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--etcd", required=True, help="etcd endpoint, http://host:port")
    parser.add_argument("--replace-delay", type=float, default=3.0)
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
