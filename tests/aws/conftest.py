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
from tests.support.moto_server import serve_moto

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
    """A provider after `setup` against moto, under a base stack of its own; AWS's public parameter
    names a Deep Learning AMI moto knows (`publish_dlami`)."""
    provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name, **fake_etcd_options(tmp_path))
    publish_dlami(moto)
    return provider


DLAMI_NAME = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023) 20261003"
DLAMI_DESCRIPTION = ("Supported EC2 instances: G4dn, G5, G6, Gr6, G6e, P4, P4de, P5, P5e, P5en, P6-B200. "
                     "PyTorch-2.13, NVIDIA driver 595.91.07, CUDA version 13.0")


def publish_dlami(moto: str, name: str = DLAMI_NAME, description: str = DLAMI_DESCRIPTION) -> str:
    """What AWS publishes: a DLAMI, and its ID in the public SSM parameter amis.DLAMI_PARAM. Nobody may
    put a parameter under /aws/ (moto refuses it, as AWS does), so it goes into moto's backend directly
    (the server runs in this process). The newest value wins, as in AWS. Returns the AMI's ID."""
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.core.utils import utcnow
    from moto.ssm.models import Parameter, ssm_backends

    from petctl.providers.aws.amis import DLAMI_PARAM

    image_id = boto(moto, "ec2").register_image(Name=name, Description=description, Architecture="x86_64",
                                                RootDeviceName="/dev/xvda")["ImageId"]
    versions = ssm_backends[DEFAULT_ACCOUNT_ID][REGION]._parameters[DLAMI_PARAM]
    versions.append(Parameter(account_id=DEFAULT_ACCOUNT_ID, name=DLAMI_PARAM, value=image_id,
                              parameter_type="String", description=None, allowed_pattern=None, keyid=None,
                              last_modified_date=utcnow(), version=len(versions) + 1,
                              data_type="aws:ec2:image"))
    return image_id


def push_worker_image(moto: str, image: str, architecture: str = "amd64") -> None:
    """What `docker buildx build --platform linux/<architecture> --push` leaves in ECR, as far as its API
    can tell: an OCI image index naming the image's platform, and an attestation entry (unknown/unknown)."""
    repository, tag = image.split("/", 1)[1].rsplit(":", 1)
    entry = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "size": 1}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {**entry, "digest": "sha256:" + "1" * 64, "platform": {"architecture": architecture, "os": "linux"}},
        {**entry, "digest": "sha256:" + "2" * 64, "platform": {"architecture": "unknown", "os": "unknown"}}]}
    boto(moto, "ecr").put_image(repositoryName=repository, imageManifest=json.dumps(index), imageTag=tag,
                                imageManifestMediaType=index["mediaType"])


def worker_image(provider) -> str:
    """The base stack's repository, at this petctl's version: where a user pushes an --image."""
    from petctl import __version__

    return f"{provider.settings['outputs']['RepositoryUri']}:{__version__}"


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
