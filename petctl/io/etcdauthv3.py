"""etcd's v3 RBAC for petctl's jobs: one user and one role per job run, read and write on the job's key
prefix only, the user authenticated by its client certificate's CN; root grants and revokes them.

The v3 counterpart of etcdauth.py's v2 users (same names, same certificates), so that one certificate
works on either store backend. Each job run's user `job-<job>-<run id>` has no password (`no_password`:
only its certificate authenticates it) and holds one role of the same name with `readwrite` on the range
`[/petctl/jobs/<job>/, /petctl/jobs/<job>0)`, i.e. every key under the prefix *with* its trailing slash,
so job `a` cannot reach `/petctl/jobs/ab/`. What such a user may and may not do beyond its prefix (leases,
watches, transactions, admin calls) is etcd's, and tests/test_etcd_auth_v3.py encodes it. One gap etcd
leaves open: a lease keep-alive is checked against nothing, so a job that learns another job's lease ID
can keep that lease alive (docs/ARCHITECTURE.md, "v3 RBAC").

Driven through etcd3aio's AuthService over gRPC, in process: etcd's JSON gateway refuses a client
certificate with a CN, and etcdctl costs a process per call. Every function is idempotent (an "already
exists" or "not found" answer is the state wanted), so a half-done call can simply be repeated. Raises
AuthError (etcdauth.py) for anything etcd refuses or cannot answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from petctl.core.keys import ROOT as JOBS_ROOT
from petctl.io.etcd import parse_endpoints
from petctl.io.etcdauth import USER_PREFIX, USER_RE, AuthError
from petctl.io.etcdpki import EtcdTls
from petctl.io.store.v3 import import_etcd3aio

CALL_TIMEOUT = 10.0  # seconds for one auth call (each is a raft proposal, or a read of the auth store)
PERM_NAMES = {0: "read", 1: "write", 2: "readwrite"}  # authpb.Permission.Type

T = TypeVar("T")


@dataclass(frozen=True)
class V3Admin:
    """Where root reaches etcd's v3 API: the endpoints python-etcd's client takes (`https://host:port`,
    comma-separated for a cluster's members) and root's client credentials."""

    endpoint: str
    tls: EtcdTls


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


def grant_job(admin: V3Admin, user: str, job: str) -> None:
    """Create `user` (certificate only, no password) with a role of the same name that may read and
    write only `job`'s prefix. Raises AuthError, or ValueError for a name that is not `job`'s user."""
    _check_user(user, job)
    grant = job_grant(job)

    async def work(client: Any, mod: ModuleType) -> None:
        auth = client.auth
        await _tolerate(auth.role_add(user, timeout=CALL_TIMEOUT), "already exists")
        await auth.role_grant_permission(user, grant.key, grant.range_end,
                                         perm_type=mod.PermissionType.READWRITE, timeout=CALL_TIMEOUT)
        await _tolerate(auth.user_add(user, no_password=True, timeout=CALL_TIMEOUT), "already exists")
        await auth.user_grant_role(user, user, timeout=CALL_TIMEOUT)

    _run(admin, f"grant v3 user {user}", work)


def revoke_user(admin: V3Admin, user: str) -> None:
    """Delete a job user and its role (nothing to do when they are gone): the user first, so that its
    certificate authenticates as nobody from then on. Raises AuthError."""
    _check_user(user)

    async def work(client: Any, mod: ModuleType) -> None:
        await _tolerate(client.auth.user_delete(user, timeout=CALL_TIMEOUT), "not found")
        await _tolerate(client.auth.role_delete(user, timeout=CALL_TIMEOUT), "not found")

    _run(admin, f"revoke v3 user {user}", work)


def job_users(admin: V3Admin) -> list[str]:
    """The job users etcd's v3 auth has now. Raises AuthError."""
    async def work(client: Any, mod: ModuleType) -> list[str]:
        return list((await client.auth.user_list(timeout=CALL_TIMEOUT)).users)

    return sorted(u for u in _run(admin, "list v3 users", work) if USER_RE.match(u))


def role_grants(admin: V3Admin, user: str) -> list[KeyGrant]:
    """The permissions `user`'s role holds (for checks and diagnostics). Raises AuthError."""
    async def work(client: Any, mod: ModuleType) -> list[KeyGrant]:
        role = await client.auth.role_get(user, timeout=CALL_TIMEOUT)
        return [KeyGrant(PERM_NAMES.get(p.permType, str(p.permType)), p.key.decode(), p.range_end.decode())
                for p in role.perm]

    return _run(admin, f"read v3 role {user}", work)


async def _tolerate(call: Awaitable[Any], answer: str) -> None:
    """Await `call`; etcd's FAILED_PRECONDITION naming `answer` ("already exists", "not found") is the
    state wanted already."""
    import grpc

    try:
        await call
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION or answer not in (e.details() or ""):
            raise


def grpc_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _run(admin: V3Admin, what: str, work: Callable[[Any, ModuleType], Awaitable[T]]) -> T:
    """Run `work(client, etcd3aio)` as root against the first member that answers. Raises AuthError."""
    import grpc

    mod = import_etcd3aio()
    try:
        creds = {"ca_cert": Path(admin.tls.ca).read_bytes(), "cert_chain": Path(admin.tls.cert).read_bytes(),
                 "cert_key": Path(admin.tls.key).read_bytes()}
        members = parse_endpoints(admin.endpoint)
    except (OSError, ValueError) as e:
        raise AuthError(f"etcd auth: {what}: {e}") from e

    async def session(host: str, port: int) -> T:
        async with mod.Etcd3Client([grpc_target(host, port)], **creds) as client:
            return await work(client, mod)

    failure: BaseException | None = None
    for host, port in members:
        try:
            return asyncio.run(session(host, port))
        except mod.EtcdConnectionError as e:  # this member is down: the next may answer
            failure = e
        except (mod.EtcdError, grpc.aio.AioRpcError, TimeoutError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e) or type(e).__name__
            raise AuthError(f"etcd auth: {what}: {detail}") from e
    raise AuthError(f"etcd auth: {what}: no member of {admin.endpoint} answered: {failure}")
