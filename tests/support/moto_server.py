"""moto as a real HTTP server on loopback: boto3 in the test and in its subprocesses talk to it like AWS."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def serve_moto() -> Iterator[str]:
    """moto as a real HTTP server on a free loopback port (boto3 and subprocesses talk to it like AWS);
    yields its endpoint URL and stops it on the way out."""
    from moto.server import ThreadedMotoServer

    from petctl.io.procs import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
