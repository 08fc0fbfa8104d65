"""Starting and stopping a local job's processes: its directory, its etcd keys and etcd user, its
detached reconciler.

A job starts whole or not at all: if any step fails, what the earlier steps made is removed again, so
a failed `run_job` leaves no directory, no etcd key, no etcd user and no process behind.

Each run of a job gets its own etcd user (`job-<job>-<run id>`, petctl/io/etcdauth.py), allowed to read
and write only `/petctl/jobs/<job>/`, in both of etcd's auth stores (v2 and v3, petctl/io/etcdauth.py),
so that either store backend works with the one client certificate written to the job's directory; the
agents and the reconciler connect with it (`JobSpec.etcd_credentials`). `kill_job`, and the next run of
the same name, delete the user from both: its certificate then authenticates as nobody.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import petctl
from petctl.core.errors import PetctlError, ProviderError
from petctl.core.keys import JobKeys
from petctl.core.spec import JobSubmission
from petctl.core.store import Store, StoreError
from petctl.io.etcdauth import AuthError, V3Admin
from petctl.io.procs import ProcRef, stop_group, wait_gone
from petctl.providers.local.jobdir import JobDir


def python_env() -> dict[str, str]:
    """Environment for our detached children: they import this very petctl, installed or not."""
    root = str(Path(petctl.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def start(job: JobDir, submission: JobSubmission, endpoint: str, store: Store, client, replace_delay: float,
          agent_command: list[str] | None, secure=None) -> None:
    """Copy the code, record the spec (job directory and `store`, on the job's backend), give the job
    its etcd user when etcd has auth (`secure`: its SecureEtcdDir; `client`, root's python-etcd client,
    grants it in v2's auth) and start the job's reconciler.

    `agent_command` replaces the agent each instance runs (None: petctl's own). Raises ProviderError
    (or the PetctlError met) after undoing every step that had been done."""
    from petctl.io.store import store_errors

    spec, script = submission.spec, submission.script
    rec: ProcRef | None = None
    v3 = v3_admin(endpoint, secure)
    try:
        forget(job, store, client, v3)
        job.path.mkdir(parents=True)
        if secure is not None:
            _give_credentials(job, submission, client, secure, v3)
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
                        agent_command=agent_command)
        job.write_desired(spec.size)
        store.put(JobKeys(spec.name).spec, spec.to_json())
        store.put(JobKeys(spec.name).desired, str(spec.size))
        cmd = [sys.executable, "-m", "petctl.providers.local.reconciler", "--job-dir", str(job.path),
               "--etcd", endpoint, "--replace-delay", str(replace_delay)]
        with open(job.reconciler_log, "ab") as log:
            proc = subprocess.Popen(cmd, cwd=str(job.path), env=python_env(), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        rec = ProcRef.of(proc.pid)
        job.update_meta(reconciler=rec.to_dict())
    except (PetctlError, OSError, StoreError, AuthError, *store_errors()) as e:
        if rec is not None:
            stop_group(rec, grace=2.0)
        forget(job, store, client, v3)
        if isinstance(e, PetctlError):
            raise
        raise ProviderError(f"could not start job {spec.name!r}: {e}") from e


def v3_admin(endpoint: str, secure) -> V3Admin | None:
    """Root's way into etcd's v3 auth (`secure`: the etcd's SecureEtcdDir), None for an etcd without
    certificates (started by an older petctl: no auth, so no users to grant)."""
    return V3Admin(endpoint, secure.root) if secure is not None else None


def _give_credentials(job: JobDir, submission: JobSubmission, client, secure, v3: V3Admin | None) -> None:
    """A new etcd user for this run (v2 and v3), its certificate in the job's directory, named in the
    spec."""
    from petctl.io.etcdauth import grant_job, job_user, new_run_id

    spec = submission.spec
    user = job_user(spec.name, new_run_id())
    job.update_meta(etcd_user=user)  # first, so that undoing a failed start finds the user to delete
    secure.job_credentials(user, job.etcd_credentials)
    grant_job(client, user, spec.name)
    if v3 is not None:
        v3.grant_job(user, spec.name)
    spec.etcd_credentials = job.etcd_credentials.resolve().as_uri()


def revoke_credentials(job: JobDir, client, v3: V3Admin | None) -> None:
    """Delete the job's etcd user from v2's and v3's auth (its agents are stopped), so its certificate
    authenticates as nobody. Raises AuthError when etcd does not answer."""
    from petctl.io.etcdauth import revoke_user

    user = job.read_meta().get("etcd_user") if job.meta_path.exists() else None
    if user:
        revoke_user(client, user)
        if v3 is not None:
            v3.revoke_user(user)


def forget(job: JobDir, store: Store, client, v3: V3Admin | None) -> None:
    """Remove a finished job's leftovers (its directory, its keys in `store` and its etcd user) before
    its name is reused. Raises AuthError or StoreError when etcd does not answer."""
    stop_processes(job, grace=2.0)
    revoke_credentials(job, client, v3)
    shutil.rmtree(job.path, ignore_errors=True)
    store.delete_dir(JobKeys(job.name).base)  # nothing there (already forgotten) is no error


def reconciler(job: JobDir) -> ProcRef | None:
    data = job.read_meta().get("reconciler")
    return ProcRef.from_dict(data) if data else None


def stop_processes(job: JobDir, grace: float) -> None:
    """Stop the reconciler (it stops its instances), then make sure no instance group is left."""
    rec = reconciler(job)
    if rec is not None and rec.alive():
        rec.signal(signal.SIGTERM)
        if not wait_gone([rec], grace + 20.0):
            rec.signal(signal.SIGKILL)
            wait_gone([rec], 5.0)
    for row in job.read_instances():
        if int(row.get("pid") or 0) <= 0:
            continue  # launched, still booting: no process was ever started
        ref = ProcRef(int(row["pid"]), row.get("start"))
        if ref.alive():
            stop_group(ref, grace=grace)
        ref.signal_group(signal.SIGKILL)
