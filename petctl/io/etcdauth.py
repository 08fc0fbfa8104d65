"""etcd authentication for petctl: one administrator, and one user per job run confined to its prefix, in
both of etcd's auth stores (v2 and v3); and the local etcd that runs with it.

Everything here runs as root (root's client certificate, see etcdpki.py). The model, the same on either
API so that one certificate works with either store backend (petctl/io/store):
- each job run gets a user (`job-<job>-<run id>`, the CN of its client certificate) holding one role of
  the same name, with read and write on the job's keys and nothing else. A new run of the same job name
  gets a new user, so a certificate of an earlier run authenticates as nobody once its user is gone.
- v2 (python-etcd's HTTP auth API, root's python-etcd client; the module's functions `grant_job`,
  `revoke_user`, `job_users`, `role_patterns`): the role holds `/petctl/jobs/<job>/*`. The `guest` role
  (what a request etcd cannot attribute to a user gets) has no permission at all. It is created empty
  *before* auth is enabled: enabling auth otherwise creates it with read and write on `/*`, for every
  client, until someone revokes it. etcd's v2 user API requires passwords, which certificates make
  unused: each is random and thrown away.
- v3 (`V3Admin`'s methods, etcd's Auth service over gRPC in process through petctl's own client,
  petctl/io/store/v3wire.py: etcd's JSON gateway refuses a client certificate with a CN, and etcdctl
  costs a process per call): the user has no
  password (its certificate only) and its role holds `readwrite` on the range
  `[/petctl/jobs/<job>/, /petctl/jobs/<job>0)`, i.e. every key under the prefix *with* its trailing
  slash, so job `a` cannot reach `/petctl/jobs/ab/`. Root is v3's only other user (`--no-password`).
  v3 auth is on even where jobs use v2: without it any client certificate could write keys through v3,
  enable v3 auth under its own root user, or add and remove cluster members. What a v3 job user may and
  may not do beyond its prefix (leases, watches, transactions, admin calls) is etcd's, and
  tests/io/test_etcd_auth_v3.py encodes it. One gap etcd leaves open: a lease keep-alive is checked against
  nothing, so a job that learns another job's lease ID can keep that lease alive (docs/ARCHITECTURE.md,
  "v3 RBAC").
Every function is idempotent (an "already exists" or "not found" answer is the state wanted), so a
half-done call can simply be repeated; each raises AuthError for anything etcd refuses or cannot answer.

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

import asyncio
import json
import re
import secrets
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from petctl.core.endpoints import parse_endpoints
from petctl.core.keys import ROOT as JOBS_ROOT
from petctl.io.etcd import EtcdServer, ServerTls, etcd_client, etcdctl_binary
from petctl.io.etcdpki import EtcdPki, EtcdTls, write_credentials
from petctl.io.files import atomic_write
from petctl.io.store import v3wire as wire

ROOT_USER = "root"
GUEST_ROLE = "guest"
USER_PREFIX = "job-"
USER_RE = re.compile(r"^job-[a-z][a-z0-9-]{0,30}[a-z0-9]-[0-9a-f]{8}$")
CALL_TIMEOUT = 10.0  # seconds for one v3 auth call (each is a raft proposal, or a read of the auth store)
CALL_ATTEMPTS = 3  # tries of one v3 auth call that etcd answers UNAVAILABLE or DEADLINE_EXCEEDED
PERM_NAMES = {0: "read", 1: "write", 2: "readwrite"}  # authpb.Permission.Type

T = TypeVar("T")


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
    """The one key pattern a job's v2 role may read and write (etcd matches it as a prefix)."""
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


# --- v3 (etcd's Auth service over gRPC: petctl/io/store/v3wire.py)


@dataclass(frozen=True)
class KeyGrant:
    """One permission of a v3 role: `perm` (read, write or readwrite) on keys in [key, range_end)."""

    perm: str
    key: str
    range_end: str


def job_prefix(job: str) -> str:
    """The one key prefix a job's v3 role may read and write, with its trailing slash."""
    return f"{JOBS_ROOT}/{job}/"


def prefix_end(prefix: str) -> str:
    """The end of the range of keys that start with `prefix` (its last byte plus one; ASCII only)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def job_grant(job: str) -> KeyGrant:
    """What a job's role holds, and nothing else."""
    prefix = job_prefix(job)
    return KeyGrant("readwrite", prefix, prefix_end(prefix))


def _check_user(user: str, job: str | None = None) -> None:
    if not USER_RE.match(user):
        raise ValueError(f"not a job user name: {user!r}")
    if job is not None and user[len(USER_PREFIX):].rsplit("-", 1)[0] != job:
        raise ValueError(f"{user!r} is not a user of job {job!r}")


async def _tolerate(call: Awaitable[Any], answer: str) -> None:
    """Await `call`; etcd's FAILED_PRECONDITION naming `answer` ("already exists", "not found") is the
    state wanted already."""
    try:
        await call
    except wire.GrpcError as e:
        if e.code != wire.Status.FAILED_PRECONDITION or answer not in e.detail:
            raise


async def _v3_call(channel: wire.Channel, rpc: wire.Rpc[T], request: Any) -> T:
    """One Auth call as root, within CALL_TIMEOUT, tried up to CALL_ATTEMPTS times when etcd is
    unavailable or too slow (each is idempotent: an add repeated answers "already exists"). Raises
    GrpcError, TimeoutError."""
    backoff = 0.05
    async with asyncio.timeout(CALL_TIMEOUT):
        for attempt in range(1, CALL_ATTEMPTS + 1):
            try:
                return await channel.unary(rpc, request, CALL_TIMEOUT)
            except wire.GrpcError as e:
                if attempt == CALL_ATTEMPTS or e.code not in (wire.Status.UNAVAILABLE,
                                                              wire.Status.DEADLINE_EXCEEDED):
                    raise
            await asyncio.sleep(backoff)
            backoff *= 2
    raise AssertionError("unreachable")


def _run(admin: V3Admin, what: str, work: Callable[[wire.Channel], Awaitable[T]]) -> T:
    """Run `work(channel)` as root against the first member that answers. Raises AuthError."""
    try:
        context = wire.client_context(admin.tls.ca, admin.tls.cert, admin.tls.key)
        members = parse_endpoints(admin.endpoint)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise AuthError(f"etcd auth: {what}: {e}") from e

    async def session(host: str, port: int) -> T:
        channel = wire.Channel([(host, port)], context, host)
        try:
            return await work(channel)
        finally:
            await channel.close()

    failure: BaseException | None = None
    for host, port in members:
        try:
            return asyncio.run(session(host, port))
        except wire.GrpcError as e:
            if e.code == wire.Status.UNAVAILABLE:  # this member is down: the next may answer
                failure = e
                continue
            raise AuthError(f"etcd auth: {what}: {e.detail or e.name}") from e
        except TimeoutError as e:
            raise AuthError(f"etcd auth: {what}: no answer within {CALL_TIMEOUT:.0f}s") from e
    raise AuthError(f"etcd auth: {what}: no member of {admin.endpoint} answered: {failure}")


@dataclass(frozen=True)
class V3Admin:
    """Where root reaches etcd's v3 API: the endpoints python-etcd's client takes (`https://host:port`,
    comma-separated for a cluster's members) and root's client credentials; what root does there, as
    methods (the v2 auth store's counterparts are this module's functions of the same names)."""

    endpoint: str
    tls: EtcdTls

    def grant_job(self, user: str, job: str) -> None:
        """Create `user` (certificate only, no password) with a role of the same name that may read and
        write only `job`'s prefix. Raises AuthError, or ValueError for a name that is not `job`'s user."""
        _check_user(user, job)
        grant = job_grant(job)
        permission = wire.Permission(permType=wire.PermissionType.READWRITE, key=grant.key.encode(),
                                     range_end=grant.range_end.encode())

        async def work(channel: wire.Channel) -> None:
            role = wire.AuthRoleAddRequest(name=user)
            await _tolerate(_v3_call(channel, wire.ROLE_ADD, role), "already exists")
            await _v3_call(channel, wire.ROLE_GRANT_PERMISSION,
                        wire.AuthRoleGrantPermissionRequest(name=user, perm=permission))
            add = wire.AuthUserAddRequest(name=user, options=wire.UserAddOptions(no_password=True))
            await _tolerate(_v3_call(channel, wire.USER_ADD, add), "already exists")
            await _v3_call(channel, wire.USER_GRANT_ROLE, wire.AuthUserGrantRoleRequest(user=user, role=user))

        _run(self, f"grant v3 user {user}", work)

    def revoke_user(self, user: str) -> None:
        """Delete a job user and its role (nothing to do when they are gone): the user first, so that its
        certificate authenticates as nobody from then on. Raises AuthError."""
        _check_user(user)

        async def work(channel: wire.Channel) -> None:
            user_gone = wire.AuthUserDeleteRequest(name=user)
            await _tolerate(_v3_call(channel, wire.USER_DELETE, user_gone), "not found")
            role_gone = wire.AuthRoleDeleteRequest(role=user)
            await _tolerate(_v3_call(channel, wire.ROLE_DELETE, role_gone), "not found")

        _run(self, f"revoke v3 user {user}", work)

    def job_users(self) -> list[str]:
        """The job users etcd's v3 auth has now. Raises AuthError."""
        async def work(channel: wire.Channel) -> list[str]:
            return list((await _v3_call(channel, wire.USER_LIST, wire.Empty())).users)

        return sorted(u for u in _run(self, "list v3 users", work) if USER_RE.match(u))

    def role_grants(self, user: str) -> list[KeyGrant]:
        """The permissions `user`'s role holds (for checks and diagnostics). Raises AuthError."""
        async def work(channel: wire.Channel) -> list[KeyGrant]:
            role = await _v3_call(channel, wire.ROLE_GET, wire.AuthRoleGetRequest(role=user))
            return [KeyGrant(PERM_NAMES.get(p.permType, str(p.permType)), p.key.decode(),
                             p.range_end.decode()) for p in role.perm]

        return _run(self, f"read v3 role {user}", work)


def _write_private(path: Path, text: str) -> None:
    """Atomic, and 0600 from the start (`atomic_write`'s temporary is created 0600 and renamed)."""
    atomic_write(path, text)


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
