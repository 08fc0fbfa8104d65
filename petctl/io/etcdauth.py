"""etcd authentication for petctl: one administrator, and one user per job run confined to its prefix.

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
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from typing import Any

from petctl.core.keys import ROOT as JOBS_ROOT
from petctl.io.etcdtls import EtcdTls

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
