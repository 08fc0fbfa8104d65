"""The local provider: every "instance" is an agent process group on this machine.

Shared infrastructure is an embedded etcd (started detached by `setup`, so it outlives the CLI); each
job gets a state directory (see jobdir.py) and a detached reconciler that plays the Auto Scaling group.
The CLI talks to this class only through the `Provider` interface; job state (ranks, rounds) is read
from etcd where the agents publish it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import petctl
from petctl.core.errors import JobExists, JobNotFound, NotSetUp, PetctlError, ProviderError, ValidationError
from petctl.core.keys import JobKeys
from petctl.core.spec import JobSpec
from petctl.providers.base import HostInfo, JobInfo, Provider
from petctl.providers.local import chaos, logs
from petctl.providers.local.jobdir import JobDir, local_root
from petctl.providers.local.procs import ProcRef, start_ticks, stop_group, wait_gone

FINAL_STATES = ("succeeded", "failed", "killed")
# Test hook: a JSON list replacing the agent command ("{config}" -> agent.json), e.g. a stub agent.
AGENT_COMMAND_ENV = "PETCTL_LOCAL_AGENT_COMMAND"
DEFAULT_REPLACE_DELAY = 3.0


def _python_env() -> dict[str, str]:
    """Environment for our detached children: they import this very petctl, installed or not."""
    root = str(Path(petctl.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


class LocalProvider(Provider):
    name = "local"

    @property
    def root(self) -> Path:
        return local_root(self.config.home)

    # --- shared infrastructure -------------------------------------------------------------------
    def _etcd_ref(self) -> ProcRef | None:
        pid = self.settings.get("etcd_pid")
        return ProcRef(int(pid), self.settings.get("etcd_start")) if pid else None

    def _etcd_healthy(self) -> bool:
        import urllib.request

        endpoint = self.settings.get("etcd_endpoint")
        ref = self._etcd_ref()
        if not endpoint or ref is None or not ref.alive():
            return False
        try:
            with urllib.request.urlopen(f"{endpoint}/v2/keys/", timeout=1.0) as r:
                return r.status == 200
        except OSError:
            return False

    def setup(self, **options: Any) -> dict[str, Any]:
        if options:
            raise ValidationError(f"the local provider takes no setup options (got {', '.join(options)})")
        if self.settings.get("ready") and self._etcd_healthy():
            return dict(self.settings)
        from petctl.io.etcd import EtcdServer

        self._stop_etcd()  # a recorded but unhealthy etcd (say, after a crash) is replaced
        etcd_dir = self.root / "etcd"
        etcd_dir.mkdir(parents=True, exist_ok=True)
        server = EtcdServer.start(etcd_dir, log_path=etcd_dir / "etcd.log", detach=True)
        settings = self.settings
        settings.update(etcd_endpoint=server.endpoint, etcd_pid=server.pid,
                        etcd_start=start_ticks(server.pid), state_dir=str(self.root), ready=True)
        self.config.provider = self.name
        self.config.save()
        return dict(settings)

    def _stop_etcd(self) -> None:
        ref = self._etcd_ref()
        if ref is not None and ref.alive():
            ref.signal(signal.SIGTERM)
            if not wait_gone([ref], 5.0):
                ref.signal(signal.SIGKILL)
                wait_gone([ref], 5.0)

    def teardown(self, force: bool = False) -> None:
        jobs = self.jobs() if self.root.exists() else []
        running = [j.name for j in jobs if j.state == "running"]
        if running and not force:
            raise PetctlError(f"jobs still running: {', '.join(running)} (kill them with `petctl kill_job "
                              "NAME`, or use `petctl teardown --force`)")
        for job in jobs:
            self._stop_job_processes(JobDir.of(self.config.home, job.name), grace=5.0)
        self._stop_etcd()
        shutil.rmtree(self.root, ignore_errors=True)
        self.config.settings.pop(self.name, None)
        self.config.save()

    def etcd_endpoint(self) -> str:
        if self.config.provider != self.name or not self.settings.get("ready"):
            raise NotSetUp("petctl is not set up: run `petctl setup` first")
        return str(self.settings["etcd_endpoint"])

    def _client(self):
        from petctl.io.etcd import etcd_client

        return etcd_client(self.etcd_endpoint(), read_timeout=3.0)

    # --- jobs ------------------------------------------------------------------------------------
    def _job_dir(self, name: str) -> tuple[JobDir, dict[str, Any]]:
        job = JobDir.of(self.config.home, name)
        meta = job.read_meta()
        if not meta.get("spec"):
            raise JobNotFound(f"no job named {name!r} (see `petctl jobs`)")
        return job, meta

    def _reconciler(self, meta: dict[str, Any]) -> ProcRef | None:
        data = meta.get("reconciler")
        return ProcRef.from_dict(data) if data else None

    def _result(self, name: str) -> dict[str, Any] | None:
        try:
            node = self._client().read(JobKeys(name).result)
            return json.loads(node.value)
        except Exception:  # not there, or etcd unreachable: the caller falls back
            return None

    def job_events(self, name: str) -> list[dict[str, Any]]:
        """The agents' timeline plus the reconciler's own (instances launched/terminated, scaling)."""
        from petctl.core.eventlog import parse_lines

        events = super().job_events(name)
        log = JobDir.of(self.config.home, name).reconciler_log
        if log.exists():
            with open(log, errors="replace") as f:
                events += list(parse_lines(f))
        return sorted(events, key=lambda e: float(e.get("ts", 0.0)))

    def mirror_url(self, name: str) -> str:
        return f"file://{JobDir.of(self.config.home, name).mirror}"

    def job(self, name: str) -> JobInfo:
        job, meta = self._job_dir(name)
        spec = JobSpec.from_dict(meta["spec"])
        state, reason = meta.get("state", ""), meta.get("reason", "")
        rec = self._reconciler(meta)
        if state not in FINAL_STATES:
            if rec is not None and rec.alive():
                state, reason = "running", ""
            else:
                result = self._result(name) or {}
                state = result.get("state", "unknown")
                reason = result.get("reason", "its reconciler is not running")
        live = [r for r in job.read_instances() if r.get("state") in ("running", "frozen")]
        return JobInfo(name=name, state=state, min_size=spec.min_size, max_size=spec.max_size,
                       desired=job.read_desired(spec.size), created_at=float(meta.get("created_at", 0)),
                       provider=self.name, reason=reason,
                       extra={"instances": len(live), "reconciler_pid": rec.pid if rec else None})

    def jobs(self) -> list[JobInfo]:
        out = []
        for path in sorted((self.root / "jobs").glob("*/job.json")):
            try:
                out.append(self.job(path.parent.name))
            except JobNotFound:
                continue
        return out

    def create_job(self, spec: JobSpec, script: Path,
                   replace_delay: float = DEFAULT_REPLACE_DELAY) -> JobInfo:
        """Validate everything first; then copy the code, write the spec and start the reconciler."""
        spec.validate()
        endpoint = self.etcd_endpoint()
        script = Path(script)
        if not script.exists():
            raise ValidationError(f"script not found: {script}")
        if script.is_dir() and not (script / spec.entrypoint).is_file():
            raise ValidationError(f"entrypoint {spec.entrypoint!r} not found in {script}")
        if replace_delay < 0:
            raise ValidationError(f"--replace-delay must be >= 0 (got {replace_delay})")
        job = JobDir.of(self.config.home, spec.name)
        if job.exists() and self.job(spec.name).state == "running":
            raise JobExists(f"job {spec.name!r} is already running (kill it with `petctl kill_job "
                            f"{spec.name}` or pick another --name)")
        if not self._etcd_healthy():
            raise NotSetUp(f"etcd at {endpoint} is not running: run `petctl setup` again")
        command = os.environ.get(AGENT_COMMAND_ENV)
        rec: ProcRef | None = None
        try:
            self._forget(job)
            job.path.mkdir(parents=True)
            if script.is_dir():
                shutil.copytree(script, job.code, ignore=shutil.ignore_patterns("__pycache__", ".git"))
            else:
                job.code.mkdir()
                shutil.copy2(script, job.code / spec.entrypoint)
            job.checkpoints.mkdir()
            job.notices.mkdir()
            spec.code_url = job.code.resolve().as_uri()
            spec.checkpoint_url = job.checkpoints.resolve().as_uri()
            spec.etcd_endpoint = endpoint
            job.update_meta(spec=spec.to_dict(), created_at=time.time(), replace_delay=replace_delay,
                            agent_command=json.loads(command) if command else None)
            job.write_desired(spec.size)
            client = self._client()
            client.write(JobKeys(spec.name).spec, spec.to_json())
            client.write(JobKeys(spec.name).desired, str(spec.size))
            cmd = [sys.executable, "-m", "petctl.providers.local.reconciler", "--job-dir", str(job.path),
                   "--etcd", endpoint, "--replace-delay", str(replace_delay)]
            with open(job.reconciler_log, "ab") as log:
                proc = subprocess.Popen(cmd, cwd=str(job.path), env=_python_env(), stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            rec = ProcRef.of(proc.pid)
            job.update_meta(reconciler=rec.to_dict())
        except Exception as e:
            if rec is not None:
                stop_group(rec, grace=2.0)
            self._forget(job)
            if isinstance(e, PetctlError):
                raise
            raise ProviderError(f"could not start job {spec.name!r}: {e}") from e
        return self.job(spec.name)

    def _forget(self, job: JobDir) -> None:
        """Remove a finished job's leftovers (its directory and etcd keys) before its name is reused."""
        import etcd

        self._stop_job_processes(job, grace=2.0)
        shutil.rmtree(job.path, ignore_errors=True)
        try:
            self._client().delete(JobKeys(job.name).base, recursive=True)
        except etcd.EtcdKeyNotFound:
            pass

    def _stop_job_processes(self, job: JobDir, grace: float) -> None:
        """Stop the reconciler (it stops its instances), then make sure no instance group is left."""
        rec = self._reconciler(job.read_meta())
        if rec is not None and rec.alive():
            rec.signal(signal.SIGTERM)
            if not wait_gone([rec], grace + 20.0):
                rec.signal(signal.SIGKILL)
                wait_gone([rec], 5.0)
        for row in job.read_instances():
            ref = ProcRef(int(row["pid"]), row.get("start"))
            if ref.alive():
                stop_group(ref, grace=grace)
            ref.signal_group(signal.SIGKILL)

    def kill_job(self, name: str) -> None:
        from petctl.io.jobresult import write_result

        job, meta = self._job_dir(name)
        if meta.get("state") not in FINAL_STATES:
            try:
                write_result(self._client(), name, "killed", "killed by the user (petctl kill_job)")
            except Exception:  # etcd down: stopping the processes still ends the job
                pass
        self._stop_job_processes(job, grace=JobSpec.from_dict(meta["spec"]).timeouts.stop_grace + 5.0)
        if job.read_meta().get("state") not in FINAL_STATES:
            job.update_meta(state="killed", reason="killed by the user (petctl kill_job)",
                            finished_at=time.time())

    def scale(self, name: str, size: int) -> None:
        info = self.job(name)
        if info.state != "running":
            raise PetctlError(f"job {name!r} is {info.state}: only a running job can be scaled")
        if not info.min_size <= size <= info.max_size:
            raise ValidationError(f"--size {size} is outside [--min {info.min_size}, --max {info.max_size}] "
                                  f"of job {name!r}")
        JobDir.of(self.config.home, name).write_desired(size)
        try:
            self._client().write(JobKeys(name).desired, str(size))
        except Exception:  # informational for agents; the reconciler reads the file
            pass

    def hosts(self, name: str) -> list[HostInfo]:
        job, _ = self._job_dir(name)
        return [chaos.host_info(row) for row in job.read_instances()]

    def terminate_host(self, name: str, host_id: str | None, mode: str = "kill", grace: float = 0.0) -> str:
        info = self.job(name)
        if info.state != "running":
            raise PetctlError(f"job {name!r} is {info.state}: no instance to take away")
        ranks = self.node_states(name).ranks
        return chaos.take_away(JobDir.of(self.config.home, name), ranks, host_id, mode, grace)

    def node_states(self, name: str):
        from petctl.jobstate import read_job_state

        self._job_dir(name)
        try:
            return read_job_state(self._client(), name)
        except PetctlError:
            raise
        except Exception as e:
            raise ProviderError(f"cannot read job {name!r} from etcd at {self.etcd_endpoint()}: {e}") from e

    def logs(self, name: str, node: str | None = None, follow: bool = False) -> Iterator[str]:
        job, _ = self._job_dir(name)
        return logs.follow_logs(job, node, follow, running=lambda: self.job(name).state == "running")
