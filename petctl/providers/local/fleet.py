"""A local job's instances as processes: launched, signalled, reaped, and recorded in instances.json.

The reconciler decides (how many, which ones, why one went); the fleet does it to the processes and
keeps the record the CLI reads. Every instance is an agent in its own process group (see instances.py),
so a signal to the group reaches the agent and its workers at once, as losing a machine would.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from petctl.core.eventlog import EventLog
from petctl.core.spec import JobSpec
from petctl.io.procs import wait_until
from petctl.providers.local import instances as inst_mod
from petctl.providers.local.instances import Instance
from petctl.providers.local.jobdir import JobDir


class Fleet:
    def __init__(self, job: JobDir, spec: JobSpec, events: EventLog, command: list[str] | None,
                 stop_grace: float) -> None:
        self.job = job
        self.spec = spec
        self.events = events
        self.command = command  # replaces the agent (the local provider's agent_command setting)
        self.stop_grace = stop_grace
        self.instances: dict[str, Instance] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.deadlines: dict[str, float] = {}  # terminating instance -> when to SIGKILL its group
        self._written: list[dict[str, Any]] | None = None

    def live(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.live]

    def launch(self, imds_endpoint: str, iid: str, desired: int) -> Instance:
        inst, proc = inst_mod.launch(self.job, self.spec, iid=iid, imds_endpoint=imds_endpoint,
                                     command=self.command)
        self.instances[inst.id] = inst
        self.procs[inst.id] = proc
        self.events.emit("instance.launched", instance=inst.id, pid=inst.pid, desired=desired)
        return inst

    def terminate(self, inst: Instance, reason: str, now: float) -> None:
        """SIGTERM the agent (it leaves gracefully); its group is SIGKILLed after `stop_grace`."""
        inst.state, inst.reason = "terminating", reason
        self.deadlines[inst.id] = now + self.stop_grace
        inst.ref.signal_group(signal.SIGCONT)
        inst.ref.signal(signal.SIGTERM)
        self.events.emit("instance.terminating", instance=inst.id, reason=reason)

    def exited(self) -> list[tuple[Instance, int]]:
        """Instances whose agent exited since the last call, with its exit code; whatever it left in its
        group (workers that outlived it) is killed with it. The caller records why (`ended`)."""
        out = []
        for iid, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            inst = self.instances[iid]
            inst.ref.signal_group(signal.SIGKILL)
            del self.procs[iid]
            self.deadlines.pop(iid, None)
            out.append((inst, code))
        return out

    def ended(self, inst: Instance, code: int, now: float) -> None:
        inst.state, inst.ended_at, inst.returncode = "terminated", now, code
        self.events.emit("instance.terminated", instance=inst.id, reason=inst.reason, returncode=code)

    def escalate(self, now: float) -> None:
        """SIGKILL the groups of instances that outstayed their SIGTERM's grace."""
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

    def stop_all(self, job_state: str, self_exit_grace: float, hurry: Callable[[], bool]) -> None:
        """Stop every instance: a short wait for agents that exit by themselves (the job is over), cut
        short once `hurry()`; then SIGTERM; after `stop_grace`, SIGKILL what is left. Records each end."""
        def all_exited() -> bool:
            return all(p.poll() is not None for p in self.procs.values())

        wait_until(lambda: hurry() or all_exited(), self_exit_grace, 0.1)
        for iid, proc in self.procs.items():
            if proc.poll() is None:
                self.instances[iid].ref.signal_group(signal.SIGCONT)
                self.instances[iid].ref.signal(signal.SIGTERM)
        wait_until(all_exited, self.stop_grace, 0.1)
        now = time.time()
        for iid, proc in self.procs.items():
            inst = self.instances[iid]
            inst.ref.signal_group(signal.SIGKILL)
            code = proc.wait()
            inst.reason = inst.reason if inst.reason == "scale-in" else f"job {job_state}"
            self.ended(inst, code, now)
        self.procs.clear()
        self.persist()
