"""The agent's IMDSv2 watcher against the local metadata endpoint: no notice (404), spot and ASG notices,
token expiry and 401 recovery, and a metadata service that is down."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from petctl.agent.imds import IMDSWatcher, Notice, parse_time
from petctl.core.eventlog import parse_lines
from petctl.io.eventlog import EventLog
from petctl.providers.local.metadata_server import LocalMetadataServer
from tests.support.notices import write_notice


def events(stream: io.StringIO, name: str) -> list[dict]:
    return [e for e in parse_lines(stream.getvalue().splitlines()) if e["event"] == name]


def test_parse_time() -> None:
    assert parse_time("1970-01-01T00:02:00Z") == 120.0


def test_no_notice_is_none(metadata_server: LocalMetadataServer) -> None:
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"))
    assert watcher.poll() is None
    assert watcher.poll() is None
    assert watcher.token_fetches == 1  # the token is reused while valid
    assert watcher.instance_id() == "i-1"


def test_spot_notice_deadline_is_the_announced_time(metadata_server: LocalMetadataServer) -> None:
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"))
    when = float(int(time.time()) + 90)  # EC2 announces whole seconds
    write_notice(metadata_server, "i-1", "spot", when)
    notice = watcher.poll()
    assert isinstance(notice, Notice)
    assert (notice.kind, notice.action, notice.deadline) == ("spot", "terminate", when)
    assert notice.raw["action"] == "terminate"


def test_asg_terminated_is_a_notice(metadata_server: LocalMetadataServer) -> None:
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"), asg_grace=120.0, clock=lambda: 1000.0)
    write_notice(metadata_server, "i-1", "asg", time.time() + 30)
    notice = watcher.poll()
    assert notice is not None
    assert (notice.kind, notice.action, notice.deadline) == ("asg", "Terminated", 1120.0)


def test_token_expiry_refetches(metadata_server: LocalMetadataServer) -> None:
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"), token_ttl=1)
    assert watcher.poll() is None
    first = watcher._token
    time.sleep(1.1)
    write_notice(metadata_server, "i-1", "spot", time.time() + 60)
    assert watcher.poll() is not None
    assert watcher.token_fetches == 2 and watcher._token != first


def test_401_refetches_token(metadata_server: LocalMetadataServer) -> None:
    """A token the server no longer accepts (say, the service restarted) costs one retry, no error."""
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"))
    assert watcher.poll() is None
    watcher._token = "revoked"  # still 'valid' by our clock, refused by the server
    assert watcher.poll() is None
    assert watcher.token_fetches == 2


def test_server_down_is_logged_once_and_never_raises(tmp_path: Path) -> None:
    srv = LocalMetadataServer(tmp_path).start()
    endpoint = srv.endpoint_for("i-1")
    srv.stop()
    stream = io.StringIO()
    watcher = IMDSWatcher(endpoint, timeout=0.5, log=EventLog("agent", stream=stream))
    assert watcher.poll() is None
    assert watcher.poll() is None
    assert len(events(stream, "imds.unreachable")) == 1


def test_recovers_when_service_comes_back(tmp_path: Path) -> None:
    srv = LocalMetadataServer(tmp_path).start()
    port = srv.port
    srv.stop()
    stream = io.StringIO()
    watcher = IMDSWatcher(f"http://127.0.0.1:{port}/i-1", timeout=0.5, log=EventLog("agent", stream=stream))
    assert watcher.poll() is None
    with LocalMetadataServer(tmp_path, port=port) as again:
        write_notice(again, "i-1", "spot", time.time() + 60)
        assert watcher.poll() is not None
    assert len(events(stream, "imds.reachable")) == 1


def test_background_watch_calls_back_once(metadata_server: LocalMetadataServer) -> None:
    got: list[Notice] = []
    called = threading.Event()

    def callback(notice: Notice) -> None:
        got.append(notice)
        called.set()

    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"), interval=0.1)
    watcher.start(callback)
    try:
        time.sleep(0.3)
        assert not got
        write_notice(metadata_server, "i-1", "spot", time.time() + 60)
        assert called.wait(5)
        time.sleep(0.3)
        assert len(got) == 1 and got[0].kind == "spot"
    finally:
        watcher.stop()


def test_stop_without_notice(metadata_server: LocalMetadataServer) -> None:
    watcher = IMDSWatcher(metadata_server.endpoint_for("i-1"), interval=0.1)
    watcher.start(lambda n: None)
    time.sleep(0.2)
    watcher.stop()
    assert not watcher._service.started and not watcher._service.running
