"""Fixtures for the AWS provider's tests: moto as a real HTTP server on loopback, dummy credentials, and a
provider whose config lives in the test's own PETCTL_HOME.

Nothing here can reach real AWS: the credentials are dummies, every client is built with the moto
endpoint URL, and the AWS config/credential files are pointed at empty files inside the test directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from petctl.core.spec import JobSpec, JobSubmission
from petctl.io.config import PetctlConfig
from tests.aws.moto_patches import patch_moto_stack_deletion
from tests.conftest import serve_moto

REGION = "us-east-1"


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """One moto server for the session (state is reset per test); stopped at the end."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    patch_moto_stack_deletion()  # the server runs in this process, so the test-only patch applies to it
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request drowns the test output
    with serve_moto() as url:
        yield url


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """Dummy credentials and no AWS config files: a test can never pick up a real profile."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "aws-empty"
    empty.write_text("")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION,
           "AWS_CONFIG_FILE": str(empty), "AWS_SHARED_CREDENTIALS_FILE": str(empty),
           "AWS_EC2_METADATA_DISABLED": "true", "PETCTL_HOME": str(tmp_path / "home"),
           # setup downloads the pinned etcd release unless given etcd_binary: never from the internet in a
           # test (this port refuses; the etcd_mirror fixture serves a release from loopback)
           "PETCTL_ETCD_DOWNLOAD_URL": "http://127.0.0.1:9"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def moto(moto_url: str, aws_env: dict[str, str]) -> str:
    """The moto endpoint. It is not reset between tests (a reset makes the next test pay several seconds
    of emulator start-up again); instead every test works under its own base stack name."""
    return moto_url


@pytest.fixture
def provider(moto: str, tmp_path: Path):
    """An AwsProvider with fast polling; `provider.lines` collects its progress output."""
    from petctl.providers import get_provider

    config = PetctlConfig.load(tmp_path / "home")
    p = get_provider(config, "aws")
    p.poll_interval = 0.05
    p.wait_timeout = 30.0
    p.lines = []
    p.progress = p.lines.append
    return p


@pytest.fixture
def stack_name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def fake_etcd_binary(directory: Path) -> Path:
    """A tiny file that passes setup's linux-x86_64 check (the real etcd is 23 MB per upload)."""
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    header[18:20] = (0x3E).to_bytes(2, "little")
    path = directory / "fake-etcd"
    path.write_bytes(bytes(header) + b"fake etcd for tests\n")
    path.with_name("etcdctl").write_bytes(bytes(header) + b"fake etcdctl for tests\n")  # shipped next to it
    return path


def fake_etcd_tarball(directory: Path, version: str, members: tuple[str, ...] = ("etcd", "etcdctl")) -> Path:
    """A tarball laid out as etcd's releases are (`etcd-<v>-linux-amd64/` with etcd, etcdctl, README.md),
    its executables tiny fakes that pass setup's linux-x86_64 check."""
    import io
    import tarfile

    binaries = fake_etcd_binary(directory)
    folder = f"etcd-{version}-linux-amd64"
    path = directory / f"{folder}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        contents = {"etcd": binaries.read_bytes(), "etcdctl": binaries.with_name("etcdctl").read_bytes(),
                    "README.md": b"etcd\n"}
        for name in (*members, "README.md"):
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size, info.mode = len(contents[name]), 0o755
            archive.addfile(info, io.BytesIO(contents[name]))
    return path


@dataclass
class EtcdMirror:
    """A loopback server laid out like etcd's GitHub releases (`<url>/<version>/<tarball>`)."""

    url: str
    root: Path
    requests: list[str]
    release: Any = None  # the EtcdRelease petctl pins while the fixture runs
    etcd_sha256: str = ""  # the fake binaries inside its tarball
    etcdctl_sha256: str = ""

    def publish(self, tarball: Path, version: str) -> str:
        """Serve `tarball` as `version`'s; its SHA-256."""
        (self.root / version).mkdir(parents=True, exist_ok=True)
        data = tarball.read_bytes()
        (self.root / version / tarball.name).write_bytes(data)
        return hashlib.sha256(data).hexdigest()


@pytest.fixture
def etcd_mirror(aws_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EtcdMirror]:
    """A fake etcd release (v3.5.99) on loopback, pinned in place of the real one (etcdbin.RELEASES) and
    named by PETCTL_ETCD_DOWNLOAD_URL, so `setup` with no etcd options downloads and verifies it."""
    import threading
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    from petctl.providers.aws import etcdbin

    root, requests = tmp_path / "mirror", []
    root.mkdir()

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's spelling)
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    mirror = EtcdMirror(url=f"http://127.0.0.1:{server.server_address[1]}", root=root, requests=requests)
    build = tmp_path / "build"
    build.mkdir()
    version = "v3.5.99"
    mirror.release = etcdbin.EtcdRelease(version, mirror.publish(fake_etcd_tarball(build, version), version))
    mirror.etcd_sha256 = hashlib.sha256((build / "fake-etcd").read_bytes()).hexdigest()
    mirror.etcdctl_sha256 = hashlib.sha256((build / "etcdctl").read_bytes()).hexdigest()
    monkeypatch.setattr(etcdbin, "RELEASES", (mirror.release,))
    monkeypatch.setenv(etcdbin.DOWNLOAD_URL_ENV, mirror.url)
    try:
        yield mirror
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def fake_etcd_options(directory: Path) -> dict[str, str]:
    """setup's options that ship the fake etcd: the binary and the hash the operator vouches for (petctl
    ships only a binary whose hash is pinned or given)."""
    path = fake_etcd_binary(directory)
    return {"etcd_binary": str(path), "etcd_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "etcdctl_sha256": hashlib.sha256(path.with_name("etcdctl").read_bytes()).hexdigest()}


@pytest.fixture
def ready(provider, moto: str, stack_name: str, tmp_path: Path):
    """A provider after `setup` against moto, under a base stack of its own."""
    provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name, **fake_etcd_options(tmp_path))
    push_worker_image(moto, provider.settings["image"])
    return provider


def push_worker_image(moto: str, image: str) -> None:
    """What `docker push` of worker_image/ does, as far as ECR's API can tell."""
    repository, tag = image.split("/", 1)[1].rsplit(":", 1)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 1,
                           "digest": "sha256:" + "0" * 64}, "layers": []}
    boto(moto, "ecr").put_image(repositoryName=repository, imageManifest=json.dumps(manifest), imageTag=tag)


def boto(moto: str, service: str):
    import boto3

    return boto3.client(service, region_name=REGION, endpoint_url=moto)


def all_stacks(moto: str) -> list[dict]:
    """Every stack in the emulator, all pages: the module's tests share one emulator, and DescribeStacks
    returns 50 stacks a page (moto, like AWS, paginates), so one call misses stacks once there are more."""
    pages = boto(moto, "cloudformation").get_paginator("describe_stacks").paginate()
    return [stack for page in pages for stack in page["Stacks"]]


def write_script(directory: Path, name: str = "train.py", text: str = "print('hello')\n") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    return path


def submit(spec: JobSpec, script: Path, **options) -> JobSubmission:
    """What `petctl run_job` hands the provider: the spec, the script and the options outside the spec."""
    return JobSubmission(spec, Path(script), **options)


def view(provider, job: str):
    """The read side of `job` on `provider`, as the CLI opens it (status, events, logs)."""
    from petctl.providers import job_view

    return job_view(provider, job)
