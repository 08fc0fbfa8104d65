"""The etcd host's own auth steps (worker_image/etcd_boot.sh.j2), run by bash against a real etcd 3.5.
Both stores: store=v3 (the default: on AWS etcd 3.6, whose only API and auth store is v3) must leave v2's
auth alone and confine each job in v3's; store=v2 (etcd 3.5 with `--enable-v2`) keeps both in step. The
jobs' certificates are then checked through the store the jobs use (petctl.io.store, the agents' own).

On AWS the CLI cannot reach etcd, so the etcd host turns auth on and creates each job's user itself, from
the users run_job indexes in the stack's bucket (petctl/providers/aws/etcdsecrets.py; the certificates are
in Secrets Manager). These tests source the rendered boot script (its functions only:
PETCTL_BOOT_LIB_ONLY) with a fake `aws` that answers as Secrets Manager and S3 would, and real curl,
etcdctl and etcd: the certificates split out of the host's secret,
the gate that admits only root's certificate until auth is on, the bootstrap (twice), and the sync of
job users in both directions, with job A's certificate then refused everywhere but A's prefix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import etcd
import pytest

from petctl.core.keys import JobKeys
from petctl.core.store import Store
from petctl.io.etcd import EtcdServer, ServerTls, etcd_client, etcd_healthy, etcdctl_binary
from petctl.io.etcdauth import V3Admin, job_grant, job_users, role_patterns
from petctl.io.etcdpki import EtcdPki, EtcdTls, write_credentials
from petctl.io.store import open_store
from petctl.providers.aws.boot import etcd_user_data
from petctl.providers.aws.etcdsecrets import host_bundle
from tests.support.etcd_auth import refused

USER_A, USER_B = "job-ja-0000000a", "job-jb-0000000b"

FAKE_AWS = r"""#!/bin/bash
echo "$*" >> "$FAKE_DIR/aws.log"
case "$1 $2" in
  "secretsmanager get-secret-value") cat "$FAKE_DIR/host-secret" ;;
  "s3api list-objects-v2") [ ! -e "$FAKE_DIR/list-fails" ] || exit 255; cat "$FAKE_DIR/job-users" ;;
  *) exit 2 ;;
esac
"""
# `install -o etcd` needs root and that user: the fake keeps everything else.
FAKE_INSTALL = ("#!/bin/bash\nargs=()\nwhile [ $# -gt 0 ]; do case \"$1\" in -o|-g) shift 2 ;; "
                "*) args+=(\"$1\"); shift ;; esac; done\nexec /usr/bin/install \"${args[@]}\"\n")


@dataclass
class Host:
    dir: Path
    root: Path
    script: Path
    env: dict[str, str]
    pki: EtcdPki
    store: str  # the stack's `store` option the script was rendered for
    server: EtcdServer | None = None
    stores: list[Store] = field(default_factory=list)  # closed by the fixture

    @property
    def pki_dir(self) -> Path:
        return self.root / "etc" / "petctl-etcd"

    @property
    def admin(self) -> EtcdTls:
        return EtcdTls(ca=str(self.pki_dir / "admin-ca.pem"), cert=str(self.pki_dir / "root.pem"),
                       key=str(self.pki_dir / "root-key.pem"))

    def bash(self, code: str, check: bool = True) -> subprocess.CompletedProcess:
        run = subprocess.run(["bash", "-c", f'. "{self.script}"; {code}'], env=self.env, capture_output=True,
                             text=True, timeout=120)
        if check:
            assert run.returncode == 0, f"{code}: {run.stdout}\n{run.stderr}"
        return run

    def start(self, ports: tuple[int, int] | None = None) -> None:
        """etcd as the unit runs it: the host's certificate, client certificates required, trusted.pem."""
        tls = ServerTls(cert=str(self.pki_dir / "server.pem"), key=str(self.pki_dir / "server-key.pem"),
                        trusted_ca=str(self.pki_dir / "trusted.pem"))
        self.server = EtcdServer.start(self.dir / "data", log_path=self.dir / "etcd.log", tls=tls,
                                       admin=self.admin, ports=ports)
        self.env["PETCTL_ETCD_LOCAL"] = self.server.endpoint

    def restart(self) -> None:
        assert self.server is not None
        ports = (self.server.client_port, self.server.peer_port)
        self.server.stop()
        self.start(ports)

    def job_users_listed(self, *users: str, keys: tuple[str, ...] = ()) -> None:
        """What `aws s3api list-objects-v2 --query 'Contents[].Key' --output text` prints when run_job
        indexed these users (`etcd-users/<job>/<user>`), plus `keys` as they are; "None" for no object."""
        listed = [f"etcd-users/{u[len('job-'):].rsplit('-', 1)[0]}/{u}" for u in users] + list(keys)
        (self.dir / "job-users").write_text("\t".join(listed) + "\n" if listed else "None\n")

    def job_tls(self, user: str) -> EtcdTls:
        pem = self.pki.job_client(user)
        return write_credentials(self.dir / "jobs" / user, self.pki.admin_ca.cert, pem.cert, pem.key)

    def root_client(self) -> etcd.Client:
        assert self.server is not None
        return etcd_client(self.server.endpoint, tls=self.admin)

    def kv(self, user: str) -> Store:
        """The job user's store, on the stack's backend (what its agents open)."""
        assert self.server is not None
        store = open_store(self.server.endpoint, self.store, self.job_tls(user), timeout=5.0)  # type: ignore[arg-type]
        self.stores.append(store)
        return store

    def v2_job_users(self) -> list[str]:
        """The job users of v2's auth: store=v3 never makes any (etcd 3.6 has no v2 auth)."""
        return job_users(self.root_client())


@pytest.fixture(params=["v3", "v2"], ids=["store=v3", "store=v2"])
def host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Host]:
    if not shutil.which("curl") or not shutil.which("openssl"):
        pytest.skip("curl and openssl are needed to run the etcd host's script")
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    for name, text in {"aws": FAKE_AWS, "install": FAKE_INSTALL}.items():
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    pki = EtcdPki.new("petctl")
    (tmp_path / "host-secret").write_text(host_bundle(pki, ("10.42.0.10",)))
    script = tmp_path / "etcd-boot.sh"
    script.write_text(etcd_user_data("petctl", "10.42.0.10", "dist/etcd/v3.5.1-x/etcd", "ab" * 32, "v3.5.1",
                                     store=request.param))
    root = tmp_path / "root"
    (root / "tmp").mkdir(parents=True)
    env = {"PATH": f"{fakes}:{os.environ['PATH']}", "PETCTL_ROOT": str(root), "PETCTL_BOOT_LIB_ONLY": "1",
           "PETCTL_BUCKET": "petctl-bucket",
           "FAKE_DIR": str(tmp_path), "ETCDCTL": etcdctl_binary(), "HOME": str(tmp_path)}
    h = Host(tmp_path, root, script, env, pki, request.param)
    h.job_users_listed()
    h.bash("fetch_certificates")
    try:
        yield h
    finally:
        for store in h.stores:
            store.close()
        if h.server is not None:
            h.server.stop(remove_data=True)


def test_the_certificates_come_split_out_of_the_hosts_secret(host: Host) -> None:
    files = sorted(p.name for p in host.pki_dir.iterdir())
    assert files == ["admin-ca.pem", "jobs-ca.pem", "root-key.pem", "root.pem", "server-key.pem",
                     "server.pem"]
    assert (host.pki_dir / "server-key.pem").stat().st_mode & 0o777 == 0o600
    assert (host.pki_dir / "root-key.pem").read_text().strip() == host.pki.root.key.strip()
    assert "get-secret-value --secret-id petctl/etcd/host" in (host.dir / "aws.log").read_text()
    (host.dir / "host-secret").write_text("# petctl-etcd admin-ca\nnot a certificate\n")
    assert host.bash("fetch_certificates", check=False).returncode != 0  # a broken secret is no boot


def test_until_auth_is_on_only_roots_certificate_gets_in(host: Host) -> None:
    host.bash("trust admin-ca")
    host.start()
    assert host.server is not None
    job = host.job_tls(USER_A)
    assert etcd_healthy(host.server.endpoint, tls=host.admin)
    assert not etcd_healthy(host.server.endpoint, tls=job)  # the jobs' CA is not trusted yet
    host.bash("bootstrap_auth")
    host.bash("bootstrap_auth")  # a second run (a restart, another member) changes nothing
    root = host.root_client()
    v2_auth = json.loads(root.http.request("GET", root.base_uri + "/v2/auth/enable").data)["enabled"]
    if host.store == "v2":
        assert v2_auth
        guest = json.loads(root.http.request("GET", root.base_uri + "/v2/auth/roles/guest").data)
        assert guest["permissions"]["kv"] == {"read": [], "write": []}
    else:
        assert v2_auth is False  # no v2 call at all: etcd 3.6 has no v2 API to answer one
    assert "Authentication Status: true" in host.bash("ctl auth status").stdout  # v3
    host.bash("trust admin-ca jobs-ca")
    assert (host.pki_dir / "trusted.pem").read_text() == host.pki.admin_ca.cert + host.pki.jobs_ca.cert
    host.restart()
    assert host.server is not None and etcd_healthy(host.server.endpoint, tls=job)  # now it connects ...
    assert refused(lambda: host.kv(USER_A).put(JobKeys("ja").round, "r"))  # ... as no user yet


def test_job_users_follow_the_users_indexed_in_the_bucket(host: Host) -> None:
    host.bash("trust admin-ca jobs-ca")
    host.start()
    host.bash("bootstrap_auth")
    assert host.server is not None
    endpoint = host.server.endpoint
    # Only well-formed user names under their own job's entry become users: a key is data, never part
    # of a path or JSON.
    host.job_users_listed(USER_A, USER_B, keys=("etcd-users/evil/job-evil", 'etcd-users/x"/job-x"-00000000',
                                               "etcd-users/root/root", "etcd-users/jx/job-jb-0000000b",
                                               "job-ja-0000000c", "etcd-users/ja/sub/job-ja-0000000d"))
    host.bash("sync_users")
    root = host.root_client()
    v3 = V3Admin(endpoint, host.admin)
    in_v2 = [USER_A, USER_B] if host.store == "v2" else []
    assert v3.job_users() == [USER_A, USER_B] and host.v2_job_users() == in_v2
    if host.store == "v2":
        assert role_patterns(root, USER_A) == ["/petctl/jobs/ja/*"]
    assert v3.role_grants(USER_A) == [job_grant("ja")]  # the prefix with its slash
    log = (host.dir / "aws.log").read_text()
    assert "s3api list-objects-v2 --bucket petctl-bucket --prefix etcd-users/ --query Contents[].Key" in log
    assert "secretsmanager list-secrets" not in log  # no secret name of the account is listed
    a, b = host.kv(USER_A), host.kv(USER_B)
    a.put(JobKeys("ja").round, "a's")
    b.put(JobKeys("jb").round, "b's")
    assert refused(lambda: a.get(JobKeys("jb").round))
    assert refused(lambda: a.delete_dir("/petctl/jobs"))
    # A listing that fails deletes nothing.
    (host.dir / "list-fails").touch()
    assert host.bash("sync_users", check=False).returncode != 0
    assert v3.job_users() == [USER_A, USER_B] and host.v2_job_users() == in_v2
    (host.dir / "list-fails").unlink()
    # kill_job deleted B's index entry: its user goes, and its certificate authenticates as nobody.
    host.job_users_listed(USER_A)
    assert f"etcd user {USER_B} deleted" in host.bash("sync_users").stdout
    assert v3.job_users() == [USER_A] and host.v2_job_users() == in_v2[:1]
    assert refused(lambda: b.get(JobKeys("jb").round))
    # A user missing from v3's auth (a half-done grant; with store=v2 a host from before v3 users) is
    # granted again.
    v3.revoke_user(USER_A)
    assert f"etcd user {USER_A} created" in host.bash("sync_users").stdout
    assert v3.job_users() == [USER_A]
    assert v3.role_grants(USER_A) == [job_grant("ja")]
    entry = host.kv(USER_A).get(JobKeys("ja").round)
    assert entry is not None and entry.value == "a's"
    assert "created" not in host.bash("sync_users").stdout  # nothing to do
    assert v3.job_users() == [USER_A] and host.v2_job_users() == in_v2[:1]
    # A replaced host starts empty: the sync gives every running job its user back.
    host.server.stop(remove_data=True)
    shutil.rmtree(host.dir / "data", ignore_errors=True)
    host.start()
    host.bash("bootstrap_auth")
    host.job_users_listed(USER_A, USER_B)
    host.bash("sync_users")
    v3 = V3Admin(host.server.endpoint, host.admin)
    assert v3.job_users() == [USER_A, USER_B] and host.v2_job_users() == in_v2
