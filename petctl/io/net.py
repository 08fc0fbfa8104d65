"""Sockets: a port that is free right now.

"Free now" is all anyone can promise: another process may take the port between this probe and the
caller's own bind, so a caller that binds later (etcd, a worker's MASTER_PORT) must handle that race
(EtcdServer.start retries on it; a round whose master port was taken fails and re-forms).
"""

from __future__ import annotations

import socket

ANY_HOST = ""  # every interface: what a port other nodes connect to must be free on


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody is bound to on `host` (`ANY_HOST` for all interfaces). Raises OSError when
    `host` is not an address of this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
