"""Preemption notices from the instance metadata service (IMDSv2), stdlib only.

EC2 announces a spot reclamation two minutes ahead at `meta-data/spot/instance-action` (404 until then),
and an Auto Scaling scale-in of an instance held by a lifecycle hook at
`meta-data/autoscaling/target-lifecycle-state` (`Terminated`). AWS advises polling every few seconds.
A rebalance recommendation (`meta-data/events/recommendations/rebalance`, 404 until issued, then
`{"noticeTime": ...}`) says the instance is at elevated risk of interruption; it may come before the
two-minute notice or without one. It is not a preemption: the watcher reports it once per recommendation
to its own callback and keeps watching for the real notice.

Launch templates require IMDSv2, so every GET carries a session token from `PUT api/token`; the token is
re-fetched shortly before it expires and whenever a GET answers 401.

A metadata service that does not answer (a local run without the endpoint, a transient error) is logged
once per outage (health.py) and treated as "no notice": the watcher never raises into the agent.

`request_detach` is the local provider's DetachInstances, asked of the instance's own endpoint
(`POST latest/petctl/detach` with a token): the group stops counting this instance and launches its
replacement at once, the instance runs on until it ends itself. On EC2 there is no such path (404): there
the agent calls Auto Scaling's DetachInstances instead. `request_end` (`POST latest/petctl/end`) is how
such a detached instance ends itself locally: its billing ends at the request, as an EC2 instance's ends
once it is shutting down, and the reconciler stops its process as the host's power-off would.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from petctl.agent.health import OutageReporter
from petctl.io.eventlog import EventLog
from petctl.io.threads import Service

TOKEN_PATH = "/latest/api/token"
SPOT_PATH = "/latest/meta-data/spot/instance-action"
ASG_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
DETACH_PATH = "/latest/petctl/detach"  # the local provider's only (providers/local/metadata_server.py)
END_PATH = "/latest/petctl/end"  # the same
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


@dataclass
class Recommendation:
    """A rebalance recommendation for this instance: elevated risk of interruption, no deadline."""

    notice_time: float  # unix ts EC2 issued it at
    raw: Any = field(default=None)


class IMDSError(Exception):
    """The metadata service did not answer usefully (connection refused, 5xx, bad token)."""


def parse_time(text: str) -> float:
    """`2026-11-21T06:13:00Z` (EC2's format) -> unix ts."""
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def _http(endpoint: str, method: str, path: str, headers: dict[str, str], timeout: float) -> tuple[int, str]:
    """One request: (status, body); an HTTP error status is returned, not raised. Raises IMDSError when
    nothing answered."""
    req = urllib.request.Request(endpoint + path, method=method, headers=headers,
                                 data=b"" if method in ("PUT", "POST") else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (fixed endpoint)
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise IMDSError(f"{method} {path}: {e}") from e


def fetch_token(endpoint: str, ttl: int, timeout: float) -> str:
    """A new IMDSv2 session token (`PUT api/token`). Raises IMDSError."""
    status, body = _http(endpoint, "PUT", TOKEN_PATH, {TOKEN_TTL_HEADER: str(int(ttl))}, timeout)
    if status != 200 or not body.strip():
        raise IMDSError(f"PUT {TOKEN_PATH}: HTTP {status}")
    return body.strip()


def request_detach(endpoint: str, timeout: float = 2.0) -> bool:
    """Ask the local provider to detach this instance from its group without lowering the desired size:
    its replacement is launched at once, and this instance runs on until it ends itself (or is
    reclaimed). True once the endpoint answered `{"detached": true}` (again on a repeated call: it is
    idempotent); False for anything else (no such endpoint, as on EC2; refused; unreachable). Never
    raises."""
    return _post(endpoint, DETACH_PATH, "detached", timeout)


def request_end(endpoint: str, timeout: float = 2.0) -> bool:
    """Ask the local provider to end this detached instance now: its billing ends at once and its
    process is stopped (SIGTERM, then SIGKILL after the provider's grace), as an EC2 host's power-off
    would. True once the endpoint answered `{"ending": true}` (again on a repeat); False for anything
    else (not detached, unknown, unreachable). Never raises."""
    return _post(endpoint, END_PATH, "ending", timeout)


def _post(endpoint: str, path: str, answer: str, timeout: float) -> bool:
    """POST `path` with a fresh token; True when the reply is 200 with `{answer: true}`. Never raises."""
    base = endpoint.rstrip("/")
    try:
        token = fetch_token(base, 60, timeout)
        status, body = _http(base, "POST", path, {TOKEN_HEADER: token}, timeout)
        return status == 200 and json.loads(body).get(answer) is True
    except Exception:  # noqa: BLE001 - the caller's fallback decides; an IMDS fault must not reach it
        return False


class IMDSWatcher:
    """Polls both notice paths (and the rebalance path when asked). `poll()` is one check;
    `start(callback, on_rebalance)` polls on a daemon thread, calls `on_rebalance(recommendation)` once
    per recommendation and `callback(notice)` once, when a notice first appears (then it stops)."""

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
        self._service = Service("petctl-imds-watch", self._run)
        self._stop = self._service.stopping
        self.rebalance_seen: float | None = None  # noticeTime of the last recommendation reported

    # --- HTTP ------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        return _http(self.endpoint, method, path, headers, self.timeout)

    def _fetch_token(self) -> str:
        # Renew a little early: a token expiring between our check and the server's is one more 401.
        self._token = fetch_token(self.endpoint, self.token_ttl, self.timeout)
        self.token_fetches += 1
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

    def _rebalance(self) -> Recommendation | None:
        status, body = self._get(REBALANCE_PATH)
        if status == 404:  # none issued (the usual answer)
            return None
        if status != 200:
            raise IMDSError(f"GET {REBALANCE_PATH}: HTTP {status}")
        try:
            doc = json.loads(body)
            return Recommendation(parse_time(doc["noticeTime"]), doc)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IMDSError(f"GET {REBALANCE_PATH}: unreadable recommendation {body!r}") from e

    def poll(self) -> Notice | None:
        """One check of both notice paths; the notice with the earliest deadline, or None. Never raises."""
        return self.check(rebalance=False)[0]

    def check(self, rebalance: bool = True) -> tuple[Notice | None, Recommendation | None]:
        """One check of the notice paths and (when `rebalance`) the recommendation path: (the notice with
        the earliest deadline or None, the recommendation or None). A path that does not answer counts
        for all of them (one outage, reported once) and reads as "nothing there". Never raises."""
        notices: list[Notice] = []
        found: Recommendation | None = None
        try:
            for check in (self._spot, self._asg):
                notice = check()
                if notice is not None:
                    notices.append(notice)
            if rebalance:
                found = self._rebalance()
        except IMDSError as e:
            self.outage.failed(e, endpoint=self.endpoint)  # one line per outage, not one per poll
        else:
            self.outage.succeeded(endpoint=self.endpoint)
        return (min(notices, key=lambda n: n.deadline) if notices else None), found

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
    def start(self, callback: Callable[[Notice], None],
              on_rebalance: Callable[[Recommendation], None] | None = None) -> None:
        """Poll every `interval` seconds on a daemon thread: `callback` once at the first notice, then
        stop polling; `on_rebalance` (when given) once per rebalance recommendation, polling on."""
        if not self._service.start(callback, on_rebalance):
            raise RuntimeError("watcher already started")

    def _run(self, callback: Callable[[Notice], None],
             on_rebalance: Callable[[Recommendation], None] | None) -> None:
        while not self._stop.is_set():
            notice, recommendation = self.check(rebalance=on_rebalance is not None)
            if recommendation is not None and on_rebalance is not None:
                self._report_rebalance(recommendation, on_rebalance)
            if notice is not None:
                self.log.emit("imds.notice", kind=notice.kind, action=notice.action, deadline=notice.deadline)
                self._call("callback", callback, notice)
                return
            self._stop.wait(self.interval)

    def _report_rebalance(self, found: Recommendation,
                          on_rebalance: Callable[[Recommendation], None]) -> None:
        """A recommendation not reported yet (EC2 keeps answering the same one): say it, hand it on."""
        if found.notice_time == self.rebalance_seen:
            return
        self.rebalance_seen = found.notice_time
        self.log.emit("rebalance.recommended", notice_time=found.notice_time)
        self._call("on_rebalance", on_rebalance, found)

    def _call(self, name: str, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except Exception as e:  # noqa: BLE001 - the agent's bug must not kill the watcher silently
            self.log.emit("imds.callback_failed", callback=name, error=repr(e))

    def stop(self) -> None:
        if not self._service.stop(timeout=self.timeout * 3 + self.interval):
            self.log.emit("imds.watch_lingered")
