"""The local provider: every "instance" is an agent process group on this machine.

Shared infrastructure is an embedded etcd (started detached by `setup`, so it outlives the CLI); each
job gets a state directory (see jobdir.py) and a detached reconciler that plays the Auto Scaling group.
The CLI talks to this class only through the `Provider` interface (plus the chaos capability); job state
(ranks, rounds) is read by petctl.jobview from etcd and the job's mirror, where the agents publish it.

Setup option `agent_command` (e.g. `petctl setup --option "agent_command=python my_agent.py {config}"`)
replaces the agent every instance runs, `{config}` standing for its agent.json: a stub agent in tests,
or the agent under a profiler or a wrapper. An empty value restores petctl's own agent.

Setup option `store` (`v2` or `v3`) picks the etcd API the jobs started from then on use
(`JobSpec.etcd_store`: agents, reconciler and readers alike); the default is `JOB_DEFAULT_BACKEND`, v3.
`store=v2` runs the same job through python-etcd on the embedded etcd 3.5's v2 API.
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any, ClassVar

from petctl.core.errors import JobExists, JobNotFound, NotSetUp, PetctlError, ValidationError
from petctl.core.keys import JobKeys
from petctl.core.spec import JobSpec, JobSubmission
from petctl.core.store import BACKENDS, JOB_DEFAULT_BACKEND, Backend, Store, StoreError
from petctl.io.etcdauth import AuthError
from petctl.jobview.accounting import BilledSpan
from petctl.jobview.prefix import file_prefix
from petctl.jobview.view import JobSources
from petctl.providers.base import HostInfo, JobInfo, Provider
from petctl.providers.capabilities import check_chaos_mode
from petctl.providers.local import chaos, etcdhost, jobstart, logs
from petctl.providers.local.jobdir import JobDir, local_root

FINAL_STATES = ("succeeded", "failed", "killed")
DEFAULT_REPLACE_DELAY = 3.0
SETUP_OPTIONS = ("agent_command", "store")


def store_option(value: str) -> Backend:
    """`--option store=v3|v2`: the etcd API the jobs started from now on use (petctl/core/store.py; v3
    by default, v2 for python-etcd until etcd 3.5's end of support). Raises ValidationError (one line)
    for another value."""
    if value not in BACKENDS:
        raise ValidationError(f"local setup option store must be one of {', '.join(BACKENDS)}, not {value!r}")
    return value  # type: ignore[return-value]


def recorded_backend(meta: dict) -> Backend:
    """The etcd API a local job's agents write with, as its recorded spec says. A spec without
    `etcd_store` was written by a petctl from before the store interface, whose agents spoke v2 only:
    such a job (still running across an upgrade) is read through v2, not the new default."""
    backend = meta.get("spec", {}).get("etcd_store", "v2")
    return backend if backend in BACKENDS else "v2"


def agent_command_option(value: str) -> list[str] | None:
    """`--option agent_command=...` as the command list the reconciler runs (None: petctl's agent)."""
    try:
        command = shlex.split(value)
    except ValueError as e:
        raise ValidationError(f"local setup option agent_command is not a command line: {e}") from None
    if command and not any("{config}" in part for part in command):
        raise ValidationError("local setup option agent_command must contain {config} (where the agent's "
                              "agent.json path goes)")
    return command or None


class LocalProvider(Provider):
    name = "local"
    run_options = frozenset({"replace_delay"})
    chaos_modes: ClassVar[tuple[str, ...]] = chaos.MODES

    @property
    def root(self) -> Path:
        return local_root(self.config.home)

    # --- shared infrastructure -------------------------------------------------------------------
    def setup(self, **options: Any) -> dict[str, Any]:
        unknown = sorted(set(options) - set(SETUP_OPTIONS))
        if unknown:
            raise ValidationError(f"unknown local setup option(s) {', '.join(unknown)}: choose from "
                                  f"{', '.join(SETUP_OPTIONS)}")
        settings = self.settings
        if "agent_command" in options:
            settings["agent_command"] = agent_command_option(str(options["agent_command"]))
        if "store" in options:
            settings["store"] = store_option(str(options["store"]))
        if not (settings.get("ready") and settings.get("etcd_pki") and etcdhost.healthy(settings)):
            # A recorded but unhealthy etcd (say, after a crash) is replaced, as is one an older petctl
            # started without client certificates and auth.
            etcdhost.stop(settings)
            settings.update(etcdhost.start(self.root), state_dir=str(self.root), ready=True)
        self.config.provider = self.name
        self.config.save()
        return dict(settings)

    def teardown(self, force: bool = False) -> None:
        jobs = self.jobs() if self.root.exists() else []
        running = [j.name for j in jobs if j.state == "running"]
        if running and not force:
            raise PetctlError(f"jobs still running: {', '.join(running)} (kill them with `petctl kill_job "
                              "NAME`, or use `petctl teardown --force`)")
        for job in jobs:
            jobstart.stop_processes(JobDir.of(self.config.home, job.name), grace=5.0)
        etcdhost.stop(self.settings)
        shutil.rmtree(self.root, ignore_errors=True)
        self.config.forget(self.name)  # config.json too, unless another provider's setup is in it

    def etcd_endpoint(self) -> str:
        if self.config.provider != self.name or not self.settings.get("ready"):
            raise NotSetUp("petctl is not set up: run `petctl setup` first")
        return str(self.settings["etcd_endpoint"])

    def _backend(self) -> Backend:
        """The etcd API of the jobs this setup starts (`--option store=`; JOB_DEFAULT_BACKEND)."""
        return self.settings.get("store") or JOB_DEFAULT_BACKEND

    def _store(self, name: str | None = None) -> Store:
        """A store as root, on job `name`'s backend (its spec's; this setup's for a new job). The caller
        closes it."""
        from petctl.io.store import open_store

        backend = self._backend()
        if name is not None and (job := JobDir.of(self.config.home, name)).meta_path.exists():
            backend = recorded_backend(job.read_meta())
        return open_store(self.etcd_endpoint(), backend, etcdhost.admin_tls(self.settings), timeout=3.0)

    def _auth_client(self):
        """Root's python-etcd client, for v2's auth store only (petctl/io/etcdauth.py)."""
        from petctl.io.etcd import etcd_client

        return etcd_client(self.etcd_endpoint(), read_timeout=3.0, tls=etcdhost.admin_tls(self.settings))

    # --- jobs ------------------------------------------------------------------------------------
    def _job_dir(self, name: str) -> tuple[JobDir, dict[str, Any]]:
        job = JobDir.of(self.config.home, name)
        meta = job.read_meta()
        if not meta.get("spec"):
            raise JobNotFound(f"no job named {name!r} (see `petctl jobs`)")
        return job, meta

    def _ended(self, name: str) -> tuple[str, str]:
        """(state, reason) of a job whose reconciler is gone without recording the end in job.json."""
        from petctl.jobview.live import read_result

        try:
            with closing(self._store(name)) as store:
                result = read_result(store, name)
        except StoreError as e:
            return "unknown", f"its reconciler is not running, and etcd did not answer ({e})"
        if result is None:
            return "unknown", "its reconciler is not running"
        return result.state, result.reason

    def job(self, name: str) -> JobInfo:
        job, meta = self._job_dir(name)
        spec = JobSpec.from_dict(meta["spec"])
        state, reason = meta.get("state", ""), meta.get("reason", "")
        rec = jobstart.reconciler(job)
        if state not in FINAL_STATES:
            if rec is not None and rec.alive():
                state, reason = "running", ""
            else:
                state, reason = self._ended(name)
        # The group's size: booting instances count, detached ones no longer do (reconciler.py).
        live = [r for r in job.read_instances()
                if r.get("state") in ("booting", "running", "frozen") and not r.get("detached_at")]
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
                continue  # a directory being created or removed right now
        return out

    def create_job(self, job: JobSubmission) -> JobInfo:
        """Validate everything first; then copy the code, write the spec and start the reconciler."""
        self.validate(job)
        endpoint = self.etcd_endpoint()
        spec = job.spec
        job_dir = JobDir.of(self.config.home, spec.name)
        if job_dir.exists() and self.job(spec.name).state == "running":
            raise JobExists(f"job {spec.name!r} is already running (kill it with `petctl kill_job "
                            f"{spec.name}` or pick another --name)")
        if not etcdhost.healthy(self.settings):
            raise NotSetUp(f"etcd at {endpoint} is not running: run `petctl setup` again")
        delay = DEFAULT_REPLACE_DELAY if job.replace_delay is None else job.replace_delay
        if (warning := torch_warning()) is not None:
            print(f"warning: {warning}", file=sys.stderr)
        spec.etcd_store = self._backend()
        with closing(self._store()) as store:
            jobstart.start(job_dir, job, endpoint, store, self._auth_client(), delay,
                           self.settings.get("agent_command"), etcdhost.secure_dir(self.settings))
        return self.job(spec.name)

    def kill_job(self, name: str) -> None:
        from petctl.io.jobresult import write_result

        job, meta = self._job_dir(name)
        reason = "killed by the user (petctl kill_job)"
        if meta.get("state") not in FINAL_STATES:
            try:
                with closing(self._store(name)) as store:
                    write_result(store, name, "killed", reason)
            except StoreError:
                pass  # etcd is down: stopping the processes below still ends the job, recorded in job.json
        jobstart.stop_processes(job, grace=JobSpec.from_dict(meta["spec"]).timeouts.stop_grace + 5.0)
        # An EC2 instance's memory goes with it; a local "instance" the chaos reclaim or a kill ended
        # leaves its snapshot directory in this machine's /dev/shm: removed now that no agent of the job
        # runs (a later agent would sweep it too, but nothing may wait for one).
        from petctl.agent.snapshots import snapshot_root, sweep

        sweep(snapshot_root(), None, job=name)
        if job.read_meta().get("state") not in FINAL_STATES:
            job.update_meta(state="killed", reason=reason, finished_at=time.time())
        try:
            v3 = jobstart.v3_admin(self.etcd_endpoint(), etcdhost.secure_dir(self.settings))
            jobstart.revoke_credentials(job, self._auth_client(), v3)
        except AuthError as e:  # the job is killed; its user goes at the next run of the name or teardown
            print(f"warning: could not delete job {name!r}'s etcd user: {e}", file=sys.stderr)

    def scale(self, name: str, size: int) -> None:
        info = self.job(name)
        if info.state != "running":
            raise PetctlError(f"job {name!r} is {info.state}: only a running job can be scaled")
        if not info.min_size <= size <= info.max_size:
            raise ValidationError(f"--size {size} is outside [--min {info.min_size}, --max {info.max_size}] "
                                  f"of job {name!r}")
        JobDir.of(self.config.home, name).write_desired(size)  # what the reconciler acts on
        try:
            with closing(self._store(name)) as store:
                store.put(JobKeys(name).desired, str(size))
        except StoreError:
            pass  # informational for agents; the reconciler reads the file written above

    def hosts(self, name: str) -> list[HostInfo]:
        job, _ = self._job_dir(name)
        return [chaos.host_info(row) for row in job.read_instances()]

    def sources(self, name: str) -> JobSources:
        job, _ = self._job_dir(name)

        def running() -> bool:
            return self.job(name).state == "running"

        backend = recorded_backend(job.read_meta())
        return JobSources(job=name, etcd_endpoint=self.etcd_endpoint(), mirror=file_prefix(job.mirror),
                          etcd_tls=etcdhost.admin_tls(self.settings), etcd_store=backend,
                          logs=lambda node, follow: logs.follow_logs(job, node, follow, running),
                          extra_events=lambda: logs.reconciler_events(job), billing=lambda: billed(job))

    # --- the chaos capability ----------------------------------------------------------------------
    def hold_capacity(self, name: str, until: float) -> None:
        """No launches for job `name` until `until` (unix time): a spot trace's capacity gap."""
        job, _ = self._job_dir(name)
        job.write_capacity_hold(until)

    def terminate_host(self, name: str, host_id: str | None, mode: str = "kill", grace: float = 0.0) -> str:
        """Take an instance away as a lost, hung, drained or reclaimed machine would go (see chaos.py).

        The round is read from etcd only to pick a target by rank (no `host_id`). A named instance needs
        no etcd: a node frozen while etcd was down must thaw while it is still down (the soak found one
        left frozen for 290 s when its thaw failed on the round read)."""
        from petctl.jobview.live import ranks_of, read_round

        check_chaos_mode(self, mode)
        info = self.job(name)
        if info.state != "running":
            raise PetctlError(f"job {name!r} is {info.state}: no instance to take away")
        ranks: dict[str, int] = {}
        if host_id is None:
            try:
                with closing(self._store(name)) as store:
                    ranks = ranks_of(read_round(store, name))
            except StoreError as e:
                raise PetctlError(f"cannot read job {name!r}'s round from etcd: {e}") from e
        return chaos.take_away(JobDir.of(self.config.home, name), ranks, host_id, mode, grace)


def billed(job: JobDir) -> list[BilledSpan]:
    """What the job's instances were billed, as its reconciler recorded them in instances.json: each
    from its launch (a replacement's boot included) to its termination or reclaim (None: running)."""
    out = []
    for row in job.read_instances():
        try:
            launched = float(row["launched_at"])
            ended = float(row["ended_at"]) if row.get("ended_at") is not None else None
        except (KeyError, TypeError, ValueError):
            continue  # a row from a petctl that did not record it: its agent's span stands in
        out.append(BilledSpan(str(row["id"]), launched, ended))
    return out


def torch_warning(find_spec: Callable[[str], object] = importlib.util.find_spec) -> str | None:
    """The local provider runs the user's script on this machine, and `pip install petctl` (CLI and
    agent) has no torch: say so before the workers fail on `import torch`, not after."""
    if find_spec("torch") is not None:
        return None
    return ("torch is not installed here, and the local provider runs your script on this machine: "
            "pip install 'petctl[elastic]'")

