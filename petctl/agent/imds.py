"""Preemption notices from the instance metadata service (IMDSv2), stdlib only.

EC2 announces a spot reclamation two minutes ahead at `meta-data/spot/instance-action` (404 until then),
and an Auto Scaling scale-in of an instance held by a lifecycle hook at
`meta-data/autoscaling/target-lifecycle-state` (`Terminated`). AWS advises polling every few seconds.
Launch templates require IMDSv2, so every GET carries a session token from `PUT api/token`; the token is
re-fetched shortly before it expires and whenever a GET answers 401.

A metadata service that does not answer (a local run without the endpoint, a transient error) is logged
once per outage (outage.py) and treated as "no notice": the watcher never raises into the agent.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from petctl.agent.outage import OutageReporter
from petctl.core.eventlog import EventLog

TOKEN_PATH = "/latest/api/token"
SPOT_PATH = "/latest/meta-data/spot/instance-action"
ASG_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
DEFAULT_ENDPOINT = "http://169.254.169.254"
ASG_GRACE = 120.0  # an ASG scale-in has no announced time; assume the spot warning's two minutes


@dataclass
class Notice:
    """A pending preemption of this instance."""

    kind: str  # "spot" | "asg"
    action: str  # spot: "terminate" | "stop" | "hibernate"; asg: the target lifecycle state
    deadline: float  # unix ts by which the instance is gone
    raw: Any = field(default=None)  # the document the metadata service returned


class IMDSError(Exception):
    """The metadata service did not answer usefully (connection refused, 5xx, bad token)."""


def parse_time(text: str) -> float:
    """`2026-11-21T06:13:00Z` (EC2's format) -> unix ts."""
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


class IMDSWatcher:
    """Polls both notice paths. `poll()` is one check; `start(callback)` polls on a daemon thread and
    calls `callback(notice)` once, when a notice first appears."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, interval: float = 2.0, token_ttl: int = 21600,
                 timeout: float = 2.0, asg_grace: float = ASG_GRACE, log: EventLog | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.interval = interval
        self.token_ttl = int(token_ttl)
        self.timeout = timeout
        self.asg_grace = asg_grace
        self.log = log or EventLog("imds")
        self.clock = clock
        self.token_fetches = 0  # for tests and diagnostics
        self._token: str | None = None
        self._token_expires = 0.0
        self.outage = OutageReporter("imds", self.log.emit, down_event="imds.unreachable",
                                     up_event="imds.reachable")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- HTTP ------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        req = urllib.request.Request(self.endpoint + path, method=method, headers=headers,
                                     data=b"" if method == "PUT" else None)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 (fixed endpoint)
                return resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, ""
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise IMDSError(f"{method} {path}: {e}") from e

    def _fetch_token(self) -> str:
        # Renew a little early: a token expiring between our check and the server's is one more 401.
        status, body = self._request("PUT", TOKEN_PATH, {TOKEN_TTL_HEADER: str(self.token_ttl)})
        if status != 200 or not body:
            raise IMDSError(f"PUT {TOKEN_PATH}: HTTP {status}")
        self.token_fetches += 1
        self._token = body.strip()
        self._token_expires = time.monotonic() + self.token_ttl * 0.9
        return self._token

    def _get(self, path: str) -> tuple[int, str]:
        """GET with a valid token: fetched when missing or (nearly) expired, and once more on a 401."""
        token = self._token if self._token and time.monotonic() < self._token_expires else None
        if token is None:
            token = self._fetch_token()
        status, body = self._request("GET", path, {TOKEN_HEADER: token})
        if status == 401:
            self._token = None
            status, body = self._request("GET", path, {TOKEN_HEADER: self._fetch_token()})
        return status, body

    # --- checks ----------------------------------------------------------------------------------
    def _spot(self) -> Notice | None:
        status, body = self._get(SPOT_PATH)
        if status == 404:
            return None
        if status != 200:
            raise IMDSError(f"GET {SPOT_PATH}: HTTP {status}")
        try:
            doc = json.loads(body)
            return Notice("spot", str(doc.get("action", "terminate")), parse_time(doc["time"]), doc)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IMDSError(f"GET {SPOT_PATH}: unreadable notice {body!r}") from e

    def _asg(self) -> Notice | None:
        status, body = self._get(ASG_PATH)
        if status == 404:  # not in an Auto Scaling group (or no lifecycle state yet)
            return None
        if status != 200:
            raise IMDSError(f"GET {ASG_PATH}: HTTP {status}")
        state = body.strip()
        if state.startswith("Terminat") or state.startswith("Warmed:Terminat"):
            return Notice("asg", state, self.clock() + self.asg_grace, state)
        return None

    def poll(self) -> Notice | None:
        """One check of both paths; the notice with the earliest deadline, or None. Never raises."""
        notices: list[Notice] = []
        try:
            for check in (self._spot, self._asg):
                notice = check()
                if notice is not None:
                    notices.append(notice)
        except IMDSError as e:
            self.outage.failed(e, endpoint=self.endpoint)  # one line per outage, not one per poll
            return min(notices, key=lambda n: n.deadline) if notices else None
        self.outage.succeeded(endpoint=self.endpoint)
        return min(notices, key=lambda n: n.deadline) if notices else None

    def instance_id(self) -> str | None:
        return self.metadata(INSTANCE_ID_PATH)

    def metadata(self, path: str) -> str | None:
        """One metadata value (e.g. `/latest/meta-data/instance-type`), or None if absent/unreachable."""
        try:
            status, body = self._get(path)
        except IMDSError:
            return None
        return body.strip() if status == 200 else None

    def identity(self) -> dict[str, str]:
        """What cost accounting needs to price this instance: type, market and availability zone."""
        fields = {"instance_type": "/latest/meta-data/instance-type",
                  "market": "/latest/meta-data/instance-life-cycle",
                  "az": "/latest/meta-data/placement/availability-zone"}
        found = {k: self.metadata(p) for k, p in fields.items()}
        return {k: v for k, v in found.items() if v}

    # --- background ------------------------------------------------------------------------------
    def start(self, callback: Callable[[Notice], None]) -> None:
        """Poll every `interval` seconds on a daemon thread; call `callback` once, then stop polling."""
        if self._thread is not None:
            raise RuntimeError("watcher already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(callback,), name="petctl-imds-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self, callback: Callable[[Notice], None]) -> None:
        while not self._stop.is_set():
            notice = self.poll()
            if notice is not None:
                self.log.emit("imds.notice", kind=notice.kind, action=notice.action, deadline=notice.deadline)
                try:
                    callback(notice)
                except Exception as e:  # noqa: BLE001 - the agent's bug must not kill the watcher silently
                    self.log.emit("imds.callback_failed", error=repr(e))
                return
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout * 3 + self.interval)
