"""A local stand-in for the EC2 instance metadata service (IMDSv2), one URL prefix per local instance.

The agent's watcher speaks real IMDSv2 to it, so the code that runs on EC2 is the code the local provider
and the tests run. Per instance `<iid>`, under `http://127.0.0.1:<port>/<iid>`:

    PUT latest/api/token                            header X-aws-ec2-metadata-token-ttl-seconds (1..21600)
    GET latest/meta-data/instance-id                (every GET needs X-aws-ec2-metadata-token, else 401)
    GET latest/meta-data/spot/instance-action       404 until a "spot" notice; then {"action","time"}
    GET latest/meta-data/autoscaling/target-lifecycle-state    InService, or Terminated on an "asg" notice
    GET latest/meta-data/events/recommendations/rebalance      404 until a rebalance recommendation; then
                                                    {"noticeTime"}, also once the "asg" notice followed it
    POST latest/petctl/detach                       (token required, else 401; not an EC2 path) the local
                                                    DetachInstances: the reconciler stops counting the
                                                    instance and launches its replacement; 200
                                                    {"detached": true}, the same again on a repeat; 404
                                                    for an instance the reconciler does not know (or
                                                    when no reconciler serves detach)
    POST latest/petctl/end                          (token required, else 401; not an EC2 path) the local
                                                    power-off of a detached instance (on EC2 the host
                                                    powers off, and shutting down ends the billing): the
                                                    reconciler ends the instance's billing now and stops
                                                    its process; 200 {"ending": true}, the same again on a
                                                    repeat; 404 for an instance it does not know, or one
                                                    still in the group (the group ends that one)

Notices are files `<notices_dir>/<iid>.json` = {"kind": "spot"|"asg", "time": <unix ts of the kill>},
written by the chaos command; the reconciler enforces the kill. A rebalance recommendation is
{"kind": "rebalance", "time": <unix ts it was issued>}; when the reconciler later scales that instance in
it writes {"kind": "asg", ..., "rebalance": <that ts>} (providers/local/rebalance.py). The server only
reads them.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TTL = 21600


def iso8601(ts: float) -> str:
    """The format EC2 uses for instance-action times: 2026-11-21T06:13:00Z."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rebalance_time(notice: dict[str, Any] | None) -> float | None:
    """When a rebalance recommendation was issued for the instance with `notice`, or None (none was)."""
    if notice is None:
        return None
    if notice.get("kind") == "rebalance":
        return float(notice["time"])
    issued = notice.get("rebalance")
    return float(issued) if isinstance(issued, (int, float)) else None


class _Tokens:
    """Issued tokens and their expiry; a token is valid only for the instance it was issued to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[str, float]] = {}

    def issue(self, instance_id: str, ttl: int) -> str:
        token = secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}  # drop expired ones
            self._tokens[token] = (instance_id, now + ttl)
        return token

    def valid(self, instance_id: str, token: str | None) -> bool:
        if not token:
            return False
        with self._lock:
            entry = self._tokens.get(token)
        return entry is not None and entry[0] == instance_id and entry[1] > time.time()


class LocalMetadataServer:
    """Serves IMDSv2 paths for every local instance from one loopback port, on a background thread."""

    def __init__(self, notices_dir: Path, host: str = "127.0.0.1", port: int = 0,
                 on_detach: Callable[[str], bool] | None = None,
                 on_end: Callable[[str], bool] | None = None) -> None:
        """`on_detach(iid)`: the reconciler detaches `iid` (called on a server thread); True when it
        knows the instance (and will detach it, or has already). `on_end(iid)`: the reconciler ends the
        detached instance `iid`; True when it will (or has already)."""
        self.notices_dir = Path(notices_dir)
        self.on_detach = on_detach
        self.on_end = on_end
        self.host = host
        self.port = port
        self.tokens = _Tokens()
        self.requests = 0  # served requests (for tests)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> LocalMetadataServer:
        server = self

        class Handler(_Handler):
            owner = server

        self._httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="petctl-imds", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> LocalMetadataServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def endpoint_for(self, instance_id: str) -> str:
        """What an agent on `instance_id` uses as its imds_endpoint (the watcher appends /latest/...)."""
        return f"{self.base_url}/{instance_id}"

    # --- state the handlers read -----------------------------------------------------------------
    def notice(self, instance_id: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.notices_dir / f"{instance_id}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("kind") not in ("spot", "asg", "rebalance"):
            return None
        if not isinstance(data.get("time"), (int, float)):
            return None
        return data


class _Handler(BaseHTTPRequestHandler):
    owner: LocalMetadataServer
    protocol_version = "HTTP/1.1"
    server_version = "EC2ws"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests and agents poll every second
        pass

    def _reply(self, code: int, body: str = "", content_type: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> tuple[str, str] | None:
        """(instance_id, path under latest/) or None for a URL outside the served tree."""
        parts = self.path.split("?", 1)[0].strip("/").split("/", 2)
        if len(parts) < 3 or parts[1] != "latest" or not parts[0]:
            return None
        return parts[0], parts[2]

    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        self.owner.requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        route = self._route()
        if route is None or route[1] != "api/token":
            return self._reply(404, "Not Found")
        try:
            ttl = int(self.headers.get(TOKEN_TTL_HEADER, ""))
        except ValueError:
            return self._reply(400, "Bad Request")
        if not 1 <= ttl <= MAX_TTL:
            return self._reply(400, "Bad Request")
        token = self.owner.tokens.issue(route[0], ttl)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header(TOKEN_TTL_HEADER, str(ttl))
        self.send_header("Content-Length", str(len(token)))
        self.end_headers()
        self.wfile.write(token.encode())

    def do_POST(self) -> None:  # noqa: N802
        self.owner.requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        route = self._route()
        actions = {"petctl/detach": (self.owner.on_detach, "detached"),
                   "petctl/end": (self.owner.on_end, "ending")}
        action = actions.get(route[1].rstrip("/")) if route is not None else None
        if route is None or action is None:
            return self._reply(404, "Not Found")
        instance_id = route[0]
        if not self.owner.tokens.valid(instance_id, self.headers.get(TOKEN_HEADER)):
            return self._reply(401, "Unauthorized")
        call, answer = action
        if call is None or not call(instance_id):
            return self._reply(404, "Not Found")
        return self._reply(200, json.dumps({answer: True}), "application/json")

    def do_GET(self) -> None:  # noqa: N802
        self.owner.requests += 1
        route = self._route()
        if route is None:
            return self._reply(404, "Not Found")
        instance_id, path = route
        if not self.owner.tokens.valid(instance_id, self.headers.get(TOKEN_HEADER)):
            return self._reply(401, "Unauthorized")
        path = path.rstrip("/")
        if path == "meta-data/instance-id":
            return self._reply(200, instance_id)
        notice = self.owner.notice(instance_id)
        if path == "meta-data/spot/instance-action":
            if notice is None or notice["kind"] != "spot":
                return self._reply(404, "Not Found")
            body = json.dumps({"action": "terminate", "time": iso8601(float(notice["time"]))})
            return self._reply(200, body, "application/json")
        if path == "meta-data/autoscaling/target-lifecycle-state":
            state = "Terminated" if notice is not None and notice["kind"] == "asg" else "InService"
            return self._reply(200, state)
        if path == "meta-data/events/recommendations/rebalance":
            issued = rebalance_time(notice)
            if issued is None:
                return self._reply(404, "Not Found")
            return self._reply(200, json.dumps({"noticeTime": iso8601(issued)}), "application/json")
        return self._reply(404, "Not Found")
