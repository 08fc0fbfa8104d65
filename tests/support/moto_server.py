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

moto deletes a stack at once: its Auto Scaling groups' instances are `terminated` before DeleteStack even
answers. In AWS a group's deletion, hence its stack's DELETE_COMPLETE, waits until its instances are
terminated, and an instance shuts down (its agent gets SIGTERM and flushes its mirror to S3) before it is.
petctl relies on that order: kill_job and the probe delete a job's S3 prefix once its stack is
DELETE_COMPLETE, so no machine of the job can write there again. The machines an emulator plays
(tests/aws/instance_emulator.py) shut down after moto says they ended; `SettledDeletions` holds
DeleteStack's answer until each emulator registered in `STACK_DELETIONS` has shut down every machine moto
no longer runs. It waits outside `OneAtATime`'s lock, so a machine's last writes are answered meanwhile.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs

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


class StackDeletions:
    """What a stack's deletion waits for: callables that return once the machines they emulate and moto
    no longer runs have shut down (`InstanceEmulator.settle`). One per process, as its moto server is."""

    def __init__(self) -> None:
        self._waits: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def register(self, wait: Callable[[], None]) -> None:
        with self._lock:
            self._waits.append(wait)

    def unregister(self, wait: Callable[[], None]) -> None:
        with self._lock:
            if wait in self._waits:
                self._waits.remove(wait)

    def settle(self) -> None:
        with self._lock:
            waits = list(self._waits)
        for wait in waits:
            wait()


STACK_DELETIONS = StackDeletions()


def is_delete_stack(environ: dict[str, Any]) -> tuple[bool, bytes | None]:
    """Whether the request is CloudFormation's DeleteStack (the query protocol: a form body), and the body
    it read to tell (None when it read none), for the caller to hand on."""
    if "/cloudformation/" not in environ.get("HTTP_AUTHORIZATION", ""):
        return False, None
    if not environ.get("CONTENT_TYPE", "").startswith("application/x-www-form-urlencoded"):
        return False, None
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    return parse_qs(body.decode("utf-8", "replace")).get("Action") == ["DeleteStack"], body


class SettledDeletions:
    """A WSGI app that answers DeleteStack only once `deletions` settled (every emulated machine moto
    ended has shut down), as AWS reports a stack deleted only once its instances are terminated. It wraps
    `OneAtATime`, so it waits with moto free to answer those machines' last requests."""

    def __init__(self, app: WsgiApp, deletions: StackDeletions) -> None:
        self.app = app
        self.deletions = deletions

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        deleting, body = is_delete_stack(environ)
        if body is not None:
            environ["wsgi.input"] = io.BytesIO(body)
        answer = self.app(environ, start_response)
        if deleting:
            self.deletions.settle()
        return answer


@contextlib.contextmanager
def serve_moto() -> Iterator[str]:
    """moto as a real HTTP server on a free loopback port (boto3 and subprocesses talk to it like AWS), taking
    one request at a time (`OneAtATime`), answering DeleteStack once the emulated machines it ended are down
    (`SettledDeletions`); yields its endpoint URL and stops it on the way out."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = SettledDeletions(OneAtATime(NoPriceList(DomainDispatcherApplication(create_backend_app))),
                           STACK_DELETIONS)
    server = make_server("127.0.0.1", 0, app, threaded=True)  # the port the kernel gives: no race for it
    thread = threading.Thread(target=server.serve_forever, name="moto-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
