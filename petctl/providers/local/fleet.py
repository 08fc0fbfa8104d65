"""A local job's instances as processes: launched, signalled, reaped, and recorded in instances.json.

The reconciler decides (how many, which ones, why one went); the fleet does it to the processes and
keeps the record the CLI reads. Every instance is an agent in its own process group (see instances.py),
so a signal to the group reaches the agent and its workers at once, as losing a machine would.

Launch and boot are two facts, as on EC2: `launch` bills the instance from now (`instance.launched`, with
its `boot_s` and the instance it `replaces`); with a boot time it has no process yet ("booting": it counts
toward the group's size, `petctl hosts` shows it pending) and `boot` starts its agent once the time is up
(`instance.booted`). A booting instance that is stopped meanwhile simply ends, its agent never started.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from petctl.core.spec import JobSpec
from petctl.io.eventlog import EventLog
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
        self.imds: dict[str, str] = {}  # booting instance -> the metadata endpoint its agent will get
        self._written: list[dict[str, Any]] | None = None

    def live(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.live]

    def launch(self, imds_endpoint: str, iid: str, desired: int, boot_s: float = 0.0, replaces: str = "",
               now: float | None = None) -> Instance:
        """One instance, billed from now. `boot_s` > 0: its agent starts that much later (`boot`)."""
        now = time.time() if now is None else now
        boot_s = max(0.0, boot_s)
        inst = Instance(id=iid, pid=0, start=None, launched_at=now, state="booting", boot_until=now + boot_s,
                        replaces=replaces)
        self.instances[iid] = inst
        self.imds[iid] = imds_endpoint
        self.events.emit("instance.launched", instance=iid, desired=desired, boot_s=boot_s,
                         replaces=replaces or None)
        if boot_s == 0:
            self._start_agent(inst)
        return inst

    def boot(self, now: float) -> None:
        """Start the agents of booting instances whose boot time is up."""
        for inst in list(self.instances.values()):
            if inst.state == "booting" and inst.boot_until is not None and now >= inst.boot_until:
                self._start_agent(inst)

    def _start_agent(self, inst: Instance) -> None:
        started, proc = inst_mod.launch(self.job, self.spec, iid=inst.id,
                                        imds_endpoint=self.imds.pop(inst.id, ""), command=self.command)
        inst.pid, inst.start, inst.booted_at = started.pid, started.start, started.booted_at
        inst.state = "running"
        self.procs[inst.id] = proc
        self.events.emit("instance.booted", instance=inst.id, pid=inst.pid,
                         boot_s=round((inst.booted_at or inst.launched_at) - inst.launched_at, 3))

    def terminate(self, inst: Instance, reason: str, now: float) -> None:
        """SIGTERM the agent (it leaves gracefully); its group is SIGKILLed after `stop_grace`. A booting
        instance ends at once: its agent never starts."""
        if not inst.has_process:
            inst.reason = reason
            self.imds.pop(inst.id, None)
            self.ended(inst, None, now)
            return
        inst.state, inst.reason = "terminating", reason
        self.deadlines[inst.id] = now + self.stop_grace
        inst.ref.signal_group(signal.SIGCONT)
        inst.ref.signal(signal.SIGTERM)
        self.events.emit("instance.terminating", instance=inst.id, reason=reason)

    def power_off(self, inst: Instance, reason: str, at: float, now: float) -> None:
        """The instance asked to end at `at` (it is detached and its agent has left): billed until then,
        as EC2 stops billing an instance that is shutting down (`instance.shutting_down`). Its agent,
        still tearing down, gets SIGTERM and `stop_grace` before its group is SIGKILLed, as a host's
        power-off gives its services; `instance.terminated` follows when it exits."""
        if not inst.has_process:
            inst.reason, inst.shutdown_at = reason, at
            self.ended(inst, None, at)
            return
        inst.state, inst.reason, inst.shutdown_at, inst.ended_at = "terminating", reason, at, at
        self.deadlines[inst.id] = now + self.stop_grace
        inst.ref.signal_group(signal.SIGCONT)
        inst.ref.signal(signal.SIGTERM)
        self.events.emit("instance.shutting_down", instance=inst.id, reason=reason, asked_at=round(at, 3))

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

    def ended(self, inst: Instance, code: int | None, now: float) -> None:
        """Recorded as terminated; billed until now, or until it asked to end (`power_off`)."""
        inst.state, inst.returncode = "terminated", code
        inst.ended_at = now if inst.shutdown_at is None else inst.shutdown_at
        self.events.emit("instance.terminated", instance=inst.id, reason=inst.reason, returncode=code)

    def escalate(self, now: float) -> None:
        """SIGKILL the groups of instances that outstayed their SIGTERM's grace."""
        for iid, deadline in list(self.deadlines.items()):
            if now >= deadline:
                self.instances[iid].ref.signal_group(signal.SIGKILL)
                del self.deadlines[iid]

    def refresh_frozen(self) -> None:
        for inst in self.live():
            if not inst.has_process:
                continue
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

        now = time.time()
        for inst in list(self.instances.values()):  # still booting: end it before its agent starts
            if inst.state == "booting":
                inst.reason = f"job {job_state} while booting"
                self.imds.pop(inst.id, None)
                self.ended(inst, None, now)
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
            ending = inst.reason == "scale-in" or inst.shutdown_at is not None  # its end was asked already
            inst.reason = inst.reason if ending else f"job {job_state}"
            self.ended(inst, code, now)
        self.procs.clear()
        self.persist()
