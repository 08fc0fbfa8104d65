"""Fixtures for the AWS provider's tests: moto as a real HTTP server on loopback, dummy credentials, and a
provider whose config lives in the test's own PETCTL_HOME.

Nothing here can reach real AWS: the credentials are dummies, every client is built with the moto
endpoint URL, and the AWS config/credential files are pointed at empty files inside the test directory.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from petctl.io.config import PetctlConfig
from tests.aws.moto_patches import patch_moto_stack_deletion
from tests.support.aws.account import REGION, publish_dlami
from tests.support.aws.etcd_release import EtcdMirror, fake_etcd_options, fake_etcd_tarball
from tests.support.moto_server import serve_moto


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


@pytest.fixture
def etcd_mirror(aws_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EtcdMirror]:
    """Fake etcd releases on loopback (v3.6.99 for store=v3, v3.5.99 for store=v2), pinned in place of the
    real ones (etcdbin.RELEASES) and named by PETCTL_ETCD_DOWNLOAD_URL, so `setup` with no etcd options
    downloads and verifies one."""
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
    for version in ("v3.5.99", "v3.6.99"):
        release = etcdbin.EtcdRelease(version, mirror.publish(fake_etcd_tarball(build, version), version))
        mirror.releases[release.version[:4]] = release
    mirror.release = mirror.releases["v3.6"]
    mirror.etcd_sha256 = hashlib.sha256((build / "fake-etcd").read_bytes()).hexdigest()
    mirror.etcdctl_sha256 = hashlib.sha256((build / "etcdctl").read_bytes()).hexdigest()
    monkeypatch.setattr(etcdbin, "RELEASES", {"v3": mirror.release, "v2": mirror.releases["v3.5"]})
    monkeypatch.setenv(etcdbin.DOWNLOAD_URL_ENV, mirror.url)
    try:
        yield mirror
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def ready(provider, moto: str, stack_name: str, tmp_path: Path):
    """A provider after `setup` against moto, under a base stack of its own; AWS's public parameter
    names a Deep Learning AMI moto knows (`publish_dlami`)."""
    provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name, **fake_etcd_options(tmp_path))
    publish_dlami(moto)
    return provider


