"""The `petctl` command line as a user runs it (a subprocess with its own PETCTL_HOME), and the checks
and inputs the CLI tests share: a one-line error, a script written to disk."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.core.eventlog import parse_line
from petctl.core.store import JOB_DEFAULT_BACKEND
from tests.support.paths import REPO
from tests.support.procs import kill_processes_with_home, processes_with_home


@dataclass
class Petctl:
    """The `petctl` command line with its own PETCTL_HOME, run in a subprocess like a user's shell."""

    home: Path
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "petctl", *args], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"petctl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n"
                                 f"{proc.stderr}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def status(self, job: str) -> dict[str, Any]:
        return self.json("status", job)

    def job_dir(self, job: str) -> Path:
        return self.home / "local" / "jobs" / job

    def processes(self) -> list[int]:
        return processes_with_home(str(self.home))

    def local_settings(self) -> dict[str, Any]:
        return json.loads((self.home / "config.json").read_text())["settings"]["local"]

    def etcd(self, read_timeout: float = 3.0):
        """A python-etcd client as root on this home's local etcd (it requires client certificates): for
        tests of etcd's auth itself (petctl/io/etcdauth.py); everything else reads through `store()`."""
        from petctl.io.etcd import etcd_client

        return etcd_client(self.local_settings()["etcd_endpoint"], read_timeout, self.etcd_root_tls())

    def store(self, read_timeout: float = 3.0):
        """A `Store` as root on this home's local etcd, on the backend its jobs use (close it after)."""
        from tests.support.store import store_for

        settings = self.local_settings()
        return store_for(settings["etcd_endpoint"], self.etcd_root_tls(),
                         settings.get("store") or JOB_DEFAULT_BACKEND, read_timeout)

    def etcd_root_tls(self):
        from petctl.io.etcdpki import EtcdTls

        return EtcdTls.in_dir(Path(self.local_settings()["etcd_pki"]) / "root")

    def events(self, job: str, name: str | None = None) -> list[dict[str, Any]]:
        """Every event line of the job's node logs, oldest first, each tagged with its node."""
        out = []
        for log in sorted(self.job_dir(job).glob("instances/*/agent.log")):
            for line in log.read_text(errors="replace").splitlines():
                record = parse_line(line)
                if record is not None and (name is None or record["event"] == name):
                    out.append({**record, "node": log.parent.name})
        return sorted(out, key=lambda r: r["ts"])

    def wait_finished(self, job: str, timeout: float) -> dict[str, Any]:
        """Wait until the provider reports the job over (its reconciler has stopped everything)."""
        deadline = time.monotonic() + timeout
        while True:
            (info,) = [j for j in self.json("jobs") if j["name"] == job]
            if info["state"] != "running":
                return info
            assert time.monotonic() < deadline, f"job {job} still running after {timeout}s: {info}"
            time.sleep(1.0)  # each poll is a CLI process: keep the CPU for the workers

    def wait_status(self, job: str, predicate: Callable[[dict[str, Any]], bool], timeout: float,
                    what: str) -> dict[str, Any]:
        """Poll `petctl status -o json` until `predicate` holds; fail with the last status and logs."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            last = self.status(job)
            if predicate(last):
                return last
            time.sleep(0.3)
        tail = self.run("logs", job, check=False).stdout.splitlines()[-40:]
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last status:\n"
                             f"{json.dumps(last, indent=1)}\nlog tail:\n" + "\n".join(tail))


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PETCTL_HOME"}
    env["PETCTL_HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def petctl_in(root: Path) -> Iterator[Petctl]:
    """A CLI whose home is `root/home`; on the way out, tear down and kill whatever is left of it."""
    home = root / "home"
    cli = Petctl(home=home, cwd=root, env=_env(home))
    try:
        yield cli
    finally:
        keep_logs(home / "local" / "jobs", root / "logs")
        if (home / "config.json").exists():
            subprocess.run([sys.executable, "-m", "petctl", "teardown", "--force"], env=cli.env,
                           capture_output=True, timeout=120)
        kill_processes_with_home(str(home))


def keep_logs(jobs: Path, dest: Path) -> None:
    """Copy every job's logs (reconciler, instances' agent logs) to `dest` before the teardown removes
    them, so a slow or failed end-to-end test can be read afterwards: pytest keeps the tmp_path of its
    last 3 runs (`logs/<job>/...`)."""
    for log in jobs.glob("*/**/*.log") if jobs.is_dir() else ():
        target = dest / log.relative_to(jobs)
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # a log removed under us: nothing to keep
            target.write_bytes(log.read_bytes())


def write_script(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(source)
    return path


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
