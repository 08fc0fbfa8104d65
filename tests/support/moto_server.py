"""moto as a real HTTP server on loopback: boto3 in the test and in its subprocesses talk to it like AWS.

moto's backends are plain dicts and lists with no locks (getmoto/moto#372), and moto's own threaded server
runs each request on its own thread. A request that reads a group, its instances or a bucket while another
changes them (a stack deletion, an agent's upload) can fail inside moto, which answers 500 with an HTML
page that botocore cannot parse and does not retry (`ResponseParserError`). AWS's services have no such
failure, so it would be a fault of the emulator, not of petctl: the server here takes requests one at a
time (`OneAtATime`), as a single consistent service. Connections are still served on their own threads,
so a client that is slow to read an answer holds no one up.

moto has no Price List API: it answers such a request by printing to its process's stdout (the test's own,
where the CLI runs in process) and failing it. `NoPriceList` answers it as AWS does for a product it lists
no price for: an empty `PriceList`, so a cost is "unknown" here, as the CLI says it is then.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class OneAtATime:
    """A WSGI app that runs the app it wraps for one request at a time: the call and the reading of its
    body both happen under one lock, so moto's state is never read while another request changes it."""

    def __init__(self, app: WsgiApp) -> None:
        self.app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with self._lock:
            body = self.app(environ, start_response)
            try:
                return list(body)
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()


class NoPriceList:
    """A WSGI app that answers the Price List API (`AWSPriceListService.*`) with no prices, and passes every
    other request to the app it wraps."""

    def __init__(self, app: WsgiApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("HTTP_X_AMZ_TARGET", "").startswith("AWSPriceListService."):
            body = json.dumps({"FormatVersion": "aws_v1", "PriceList": []}).encode()
            start_response("200 OK", [("Content-Type", "application/x-amz-json-1.1"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        return self.app(environ, start_response)


@contextlib.contextmanager
def serve_moto() -> Iterator[str]:
    """moto as a real HTTP server on a free loopback port (boto3 and subprocesses talk to it like AWS), taking
    one request at a time (`OneAtATime`); yields its endpoint URL and stops it on the way out."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = OneAtATime(NoPriceList(DomainDispatcherApplication(create_backend_app)))
    server = make_server("127.0.0.1", 0, app, threaded=True)  # the port the kernel gives: no race for it
    thread = threading.Thread(target=server.serve_forever, name="moto-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
