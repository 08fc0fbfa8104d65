"""etcd authentication for petctl: one administrator, and one user per job run confined to its prefix;
and the local etcd that runs with it.

Everything here runs as root (a python-etcd client with root's certificate, see etcdpki.py). The model:
- v2 auth on: the `guest` role (what a request etcd cannot attribute to a user gets) has no permission
  at all. It is created empty *before* auth is enabled: enabling auth otherwise creates it with read and
  write on `/*`, for every client, until someone revokes it.
- each job run gets a user (`job-<job>-<run id>`, the CN of its client certificate) holding one role of
  the same name, with read and write on `/petctl/jobs/<job>/*` and nothing else. A new run of the same job
  name gets a new user, so a certificate of an earlier run authenticates as nobody once its user is gone.
- v3 auth on too, with root its only user: petctl never uses v3, and without auth etcd's v3 API (gRPC on
  the same port) would let any client certificate write keys, enable v3 auth under its own root user, or
  add and remove cluster members.
Passwords are required by etcd's v2 user API but never used (certificates authenticate): each is random
and thrown away (v3's root has none: `--no-password`, certificate only). Every function is idempotent, so
a half-done call can simply be repeated.

The local provider's etcd, and the tests', is this same model on this machine (`SecureEtcdDir`,
`start_secure`): client certificates required and auth on, so local jobs exercise the real code path:
root administers, each job run's agents connect as a user confined to `/petctl/jobs/<job>/`. On disk,
under one private directory (0700; keys 0600):
    pki.json            both CAs with their keys, and root's certificate (the operator's secret)
    server/             etcd's certificate and key, and trusted.pem (both CAs: root's and the jobs')
    root/               root's client credentials (ca.pem, cert.pem, key.pem)
Each job's credentials are written where the provider keeps the job (`job_credentials`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl.core.keys import ROOT as JOBS_ROOT
from petctl.io.etcd import EtcdServer, ServerTls, etcd_client, etcdctl_binary
from petctl.io.etcdpki import EtcdPki, EtcdTls, write_credentials

ROOT_USER = "root"
GUEST_ROLE = "guest"
USER_PREFIX = "job-"
USER_RE = re.compile(r"^job-[a-z][a-z0-9-]{0,30}[a-z0-9]-[0-9a-f]{8}$")


class AuthError(Exception):
    """etcd refused or failed an auth change (the message says which, and etcd's answer)."""


def job_user(job: str, run_id: str) -> str:
    """The etcd user (and role) of one run of `job`; `run_id` is 8 hex digits."""
    user = f"{USER_PREFIX}{job}-{run_id}"
    if not USER_RE.match(user):
        raise ValueError(f"not a job user name: {user!r}")
    return user


def new_run_id() -> str:
    return secrets.token_hex(4)


def job_pattern(job: str) -> str:
    """The one key pattern a job's role may read and write (etcd matches it as a prefix)."""
    return f"{JOBS_ROOT}/{job}/*"


def _call(client, method: str, path: str, body: dict[str, Any] | None = None,
          ok: tuple[int, ...] = ()) -> dict[str, Any]:
    """One request to etcd's v2 auth API as `client`; its JSON answer ({} for an empty one). A status in
    `ok` (besides 2xx) is an expected answer, returned as {"status": n}. Raises AuthError."""
    url = client.base_uri + "/v2/auth/" + path
    headers = {"Content-Type": "application/json"}
    try:
        response = client.http.request(method, url, body=json.dumps(body) if body is not None else None,
                                       headers=headers, timeout=client.read_timeout)
    except Exception as e:  # noqa: BLE001 - urllib3's errors (connection, TLS, timeout): one line
        raise AuthError(f"etcd auth {method} {path}: {e}") from e
    if response.status in ok:
        return {"status": response.status}
    if not 200 <= response.status < 300:
        raise AuthError(f"etcd auth {method} {path}: HTTP {response.status}: "
                        f"{response.data.decode(errors='replace').strip()[:200]}")
    return json.loads(response.data.decode() or "{}")


def bootstrap(client, etcdctl: str, endpoint: str, tls: EtcdTls) -> None:
    """Turn auth on (v2 and v3) on an etcd that may have none yet; `client` must present root's
    certificate. Safe to call on an etcd already bootstrapped (a restart, a second member). Raises
    AuthError."""
    _bootstrap_v2(client)
    _bootstrap_v3(etcdctl, endpoint, tls)


def _bootstrap_v2(client) -> None:
    empty = {"kv": {"read": [], "write": []}}
    created = _call(client, "PUT", f"roles/{GUEST_ROLE}", {"role": GUEST_ROLE, "permissions": empty},
                    ok=(409,))
    if created.get("status") == 409:
        guest = _call(client, "GET", f"roles/{GUEST_ROLE}")
        kv = (guest.get("permissions") or {}).get("kv") or {}
        if kv.get("read") or kv.get("write"):  # left by an earlier enable: take every permission back
            _call(client, "PUT", f"roles/{GUEST_ROLE}",
                  {"role": GUEST_ROLE, "revoke": {"kv": {"read": kv.get("read") or [],
                                                         "write": kv.get("write") or []}}})
    if not _call(client, "GET", "enable").get("enabled"):
        _call(client, "PUT", f"users/{ROOT_USER}", {"user": ROOT_USER, "password": secrets.token_hex(32)})
        _call(client, "PUT", "enable", ok=(409,))


def _bootstrap_v3(etcdctl: str, endpoint: str, tls: EtcdTls) -> None:
    """v3 auth through etcdctl (gRPC): etcd's JSON gateway refuses clients whose certificate has a CN."""
    def ctl(*args: str, check: bool = True) -> str:
        cmd = [etcdctl, f"--endpoints={endpoint}", f"--cacert={tls.ca}", f"--cert={tls.cert}",
               f"--key={tls.key}", "--dial-timeout=5s", "--command-timeout=10s", *args]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if check and run.returncode != 0:
            raise AuthError(f"etcdctl {args[0]} {args[1] if len(args) > 1 else ''}: "
                            f"{(run.stderr or run.stdout).strip().splitlines()[-1:]}")
        return run.stdout + run.stderr

    if "Authentication Status: true" in ctl("auth", "status"):
        return
    if "already exists" not in ctl("user", "add", ROOT_USER, "--no-password", check=False):  # CN auth only
        ctl("user", "get", ROOT_USER)  # raises with etcdctl's message when the add really failed
    ctl("user", "grant-role", ROOT_USER, "root")
    ctl("auth", "enable")


def grant_job(client, user: str, job: str) -> None:
    """Create `user` with a role of the same name that may read and write only `job`'s prefix.
    Raises AuthError (or ValueError for a name that is not a job user)."""
    if not USER_RE.match(user):
        raise ValueError(f"not a job user name: {user!r}")
    pattern = job_pattern(job)
    perms = {"kv": {"read": [pattern], "write": [pattern]}}
    _call(client, "PUT", f"roles/{user}", {"role": user, "permissions": perms}, ok=(409,))
    _call(client, "PUT", f"users/{user}", {"user": user, "password": secrets.token_hex(32), "roles": [user]},
          ok=(409,))


def revoke_user(client, user: str) -> None:
    """Delete a job user and its role (nothing to do when they are gone). Raises AuthError."""
    if not USER_RE.match(user):
        raise ValueError(f"not a job user name: {user!r}")
    _call(client, "DELETE", f"users/{user}", ok=(404,))
    _call(client, "DELETE", f"roles/{user}", ok=(404,))


def job_users(client) -> list[str]:
    """The job users etcd has now. Raises AuthError."""
    listed = _call(client, "GET", "users").get("users") or []
    names = [u.get("user", "") if isinstance(u, dict) else str(u) for u in listed]
    return sorted(n for n in names if USER_RE.match(n))


def role_patterns(client, user: str) -> list[str]:
    """The key patterns `user`'s role may write (for checks and diagnostics). Raises AuthError."""
    role = _call(client, "GET", f"roles/{user}")
    return list(((role.get("permissions") or {}).get("kv") or {}).get("write") or [])


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class SecureEtcdDir:
    """The private directory described in the module docstring."""

    path: Path

    @property
    def server(self) -> ServerTls:
        d = self.path / "server"
        return ServerTls(cert=str(d / "cert.pem"), key=str(d / "key.pem"), trusted_ca=str(d / "trusted.pem"))

    @property
    def root(self) -> EtcdTls:
        return EtcdTls.in_dir(self.path / "root")

    def pki(self):
        """The operator's PKI (both CA keys). Raises OSError or ValueError."""
        return EtcdPki.from_json((self.path / "pki.json").read_text())

    @classmethod
    def create(cls, path: str | Path, name: str = "petctl") -> SecureEtcdDir:
        """A new PKI for an etcd on 127.0.0.1, written to `path` (replacing what was there)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
        pki = EtcdPki.new(name)
        _write_private(path / "pki.json", pki.to_json())
        server = pki.server(("127.0.0.1",))
        write_credentials(path / "server", pki.admin_ca.cert, server.cert, server.key)
        _write_private(path / "server" / "trusted.pem", pki.trusted_clients)
        write_credentials(path / "root", pki.admin_ca.cert, pki.root.cert, pki.root.key)
        return cls(path)

    def reissue_server(self, ips: tuple[str, ...]) -> None:
        """etcd's certificate again, valid for `ips` too (a client that reaches this etcd at another
        address: a network namespace, a forwarder). etcd reads its certificate files at each new TLS
        handshake, so a running etcd presents the new one from the next connection on."""
        pki = self.pki()
        server = pki.server(("127.0.0.1", *ips))
        write_credentials(self.path / "server", pki.admin_ca.cert, server.cert, server.key)

    def job_credentials(self, user: str, dest: str | Path) -> EtcdTls:
        """A client certificate for `user` (a job run's etcd user), written to `dest`. The user itself
        is created in etcd by grant_job."""
        pki = self.pki()
        pem = pki.job_client(user)
        return write_credentials(dest, pki.admin_ca.cert, pem.cert, pem.key)

    def root_client(self, endpoint: str, read_timeout: float = 5.0):
        return etcd_client(endpoint, read_timeout=read_timeout, tls=self.root)


def start_secure(secure: SecureEtcdDir, data_dir: str | Path, log_path: str | Path | None = None,
                 detach: bool = False, ports: tuple[int, int] | None = None) -> EtcdServer:
    """Start etcd with `secure`'s certificates and turn auth on (idempotent: a restart keeps it).
    Nobody else holds a certificate yet when a new PKI's etcd starts, so enabling auth after the start
    leaves no window. Raises ProviderError (etcd did not start) or AuthError."""
    server = EtcdServer.start(data_dir, log_path=log_path, detach=detach, ports=ports, tls=secure.server,
                              admin=secure.root)
    try:
        bootstrap(secure.root_client(server.endpoint), etcdctl_binary(), server.endpoint, secure.root)
    except BaseException:
        server.stop()
        raise
    return server
