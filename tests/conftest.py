"""Shared fixtures: a private PETCTL_HOME per test, the CLI run as a user runs it, and cleanup that holds
even when a test fails; moto's S3 and the local IMDSv2 endpoint for the modules that need them. Only
fixtures and hooks live here; what tests import by name lives in tests/support/.

Every process the local provider starts (etcd, reconcilers, agents, workers) inherits PETCTL_HOME, so
"the processes of this test" are exactly those whose environment names its home. Each test's fixture
kills its own; a session-level net kills any left under this session's temp root.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.cli import Petctl, petctl_in
from tests.support.localstub import STUB_AGENT
from tests.support.moto_server import serve_moto
from tests.support.procs import kill_processes_with_home

if TYPE_CHECKING:
    from petctl.providers.local.metadata_server import LocalMetadataServer

# gRPC's fork handlers off in the test processes too, as the v3 store sets them before it imports gRPC
# (petctl/io/store/v3.py). A test helper may import gRPC first (tests/support/etcd_auth.py), and then a
# worker the test forks (WorkerGroup's preexec_fn) restarted gRPC's poller in the child, which printed
# "epoll_wait error: Bad file descriptor" into the worker's output once its descriptors were closed: seen
# as a worker's error line in test_worker_failure (CI rehearsal, 2026-11-28).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

# A report whose text holds a lone surrogate would end an xdist worker's session as an internal error and
# stop the whole run (tests/support/xdist_reports.py says how, and when CI hit it).
pytest_plugins = ["tests.support.xdist_reports"]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many workers `-n auto` (pytest.ini) starts: 3 on 2 or 3 CPUs, 2 on one, then one per 2 CPUs up
    to 8 (never fewer than 3). Most end-to-end tests wait on timers, etcd and other processes as much as
    they compute: on CI's 2 cores, 2 workers kept the CPU 71 % busy (851 s of pytest, 2026-11-28), 3
    workers took 800 s in the same tree. Not one per CPU on larger hosts: an end-to-end test runs an
    etcd, agents and torch workers, several processes that are busy at once. The tests' time bounds
    hold on a loaded machine (each slow test is run with CPU burners before it lands); a test that fails
    only with 3 workers has a race, found sooner."""
    from petctl.io.procs import host_cores

    cpus = host_cores()
    return 2 if cpus == 1 else max(3, min(cpus // 2, 8))


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


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory):
    """A real etcd 3.5 on 127.0.0.1 for a module whose tests drive agents by hand (no provider)."""
    from petctl.io.etcd import EtcdServer

    server = EtcdServer.start(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop(remove_data=True)


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


@pytest.fixture
def stub(local: Petctl, tmp_path: Path) -> Petctl:
    """The CLI after `petctl setup`, with a stub agent (tests/support/localstub.py) in place of the real
    one: the local reconciler is then tested fast and apart from the agent."""
    agent = tmp_path / "stub_agent.py"
    agent.write_text(STUB_AGENT)
    # The local provider's documented seam for another agent: `setup --option agent_command=...`.
    local.run("setup", "--option", f"agent_command={sys.executable} {agent} {{config}}")
    (tmp_path / "train.py").write_text("print('never run by the stub')\n")
    return local
