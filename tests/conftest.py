"""Shared fixtures: a private PETCTL_HOME per test, the CLI run as a user runs it, and cleanup that holds
even when a test fails; moto's S3 and the local IMDSv2 endpoint for the modules that need them.

Every process the local provider starts (etcd, reconcilers, agents, workers) inherits PETCTL_HOME, so
"the processes of this test" are exactly those whose environment names its home. Each test's fixture
kills its own; a session-level net kills any left under this session's temp root.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from petctl.core.eventlog import parse_line

if TYPE_CHECKING:
    from petctl.providers.local.metadata_server import LocalMetadataServer

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def processes_with_home(prefix: str) -> list[int]:
    """Pids whose PETCTL_HOME starts with `prefix` (ours only: we set that variable ourselves)."""
    needle = f"PETCTL_HOME={prefix}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if any(item.startswith(needle) for item in env):
            pids.append(int(entry))
    return pids


def kill_processes_with_home(prefix: str) -> list[int]:
    pids = processes_with_home(prefix)
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return pids


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
        """A python-etcd client as root on this home's local etcd (it requires client certificates)."""
        from petctl.io.etcd import etcd_client

        return etcd_client(self.local_settings()["etcd_endpoint"], read_timeout, self.etcd_root_tls())

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
        if (home / "config.json").exists():
            subprocess.run([sys.executable, "-m", "petctl", "teardown", "--force"], env=cli.env,
                           capture_output=True, timeout=120)
        kill_processes_with_home(str(home))


@pytest.fixture
def petctl(tmp_path: Path) -> Iterator[Petctl]:
    """A CLI with a fresh home (not set up)."""
    with petctl_in(tmp_path) as cli:
        yield cli


@pytest.fixture
def local(petctl: Petctl) -> Petctl:
    """The CLI after `petctl setup` (local provider, embedded etcd)."""
    petctl.run("setup")
    return petctl


@pytest.fixture(scope="module")
def shared_local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Petctl]:
    """One set-up home for a whole module of tests that must not change it (validation checks)."""
    with petctl_in(tmp_path_factory.mktemp("shared")) as cli:
        cli.run("setup")
        yield cli


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Safety net: whatever a test leaked under this session's temp root dies with the session."""
    root = tmp_path_factory.getbasetemp()
    yield
    kill_processes_with_home(str(root))


def write_script(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(source)
    return path


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory):
    """A real etcd 3.5 on 127.0.0.1 for a module whose tests drive agents by hand (no provider)."""
    from petctl.io.etcd import EtcdServer

    server = EtcdServer.start(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop(remove_data=True)


@contextlib.contextmanager
def serve_moto() -> Iterator[str]:
    """moto as a real HTTP server on a free loopback port (boto3 and subprocesses talk to it like AWS);
    yields its endpoint URL and stops it on the way out."""
    from moto.server import ThreadedMotoServer

    from petctl.io.procs import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """One moto server per module: tests keep apart by fresh bucket names, not by a fresh server."""
    with serve_moto() as endpoint:
        yield endpoint


@pytest.fixture
def moto_env(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The moto endpoint, with dummy credentials, a region and AWS_ENDPOINT_URL in the environment (so a
    worker subprocess reaches moto too) and no AWS_PROFILE that could name a real account."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_endpoint


@pytest.fixture
def s3_url(moto_env: str) -> str:
    """A checkpoint URL in a fresh bucket on moto."""
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_env, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/jobs/demo/checkpoints"


@pytest.fixture(params=["file", "s3"])
def checkpoint_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same test on both store backends: a directory (file://) and a bucket on moto's S3."""
    if request.param == "file":
        return (tmp_path / "ckpt").as_uri()
    return request.getfixturevalue("s3_url")


@pytest.fixture
def metadata_server(tmp_path: Path) -> Iterator[LocalMetadataServer]:
    """The local IMDSv2 endpoint on loopback, answering from notice files under tmp_path/notices."""
    from petctl.providers.local.metadata_server import LocalMetadataServer

    with LocalMetadataServer(tmp_path / "notices") as server:
        yield server


def write_notice(server: LocalMetadataServer, iid: str, kind: str, when: float) -> None:
    """What the chaos command does: a spot or ASG notice for instance `iid`, the kill due at `when`."""
    server.notices_dir.mkdir(parents=True, exist_ok=True)
    (server.notices_dir / f"{iid}.json").write_text(json.dumps({"kind": kind, "time": when}))
