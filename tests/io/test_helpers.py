"""The small I/O helpers written once in petctl/io: atomic files, process liveness, dying with the parent,
a free port, polling with a deadline, and etcd's health."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from petctl.io import procs
from petctl.io.etcd import etcd_healthy
from petctl.io.files import atomic_write, atomic_writer, is_temporary
from petctl.io.procs import free_port, wait_until

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_atomic_write_replaces_whole_and_a_failed_write_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "f.json"
    atomic_write(path, "first")
    atomic_write(path, b"second")
    assert path.read_text() == "second"
    with pytest.raises(RuntimeError):
        with atomic_writer(path) as f:
            f.write(b"half")
            raise RuntimeError("the writer failed")
    assert path.read_text() == "second"
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]  # no temporary left behind


def test_concurrent_writers_of_one_path_never_share_a_temporary(tmp_path: Path) -> None:
    """The mirror's old writer named its temporary after the pid, so two threads could rename each other's
    half-written file or fail on a vanished one. Now every write has its own."""
    path = tmp_path / "status.json"
    payloads = [json.dumps({"writer": w, "pad": "x" * 20000}).encode() for w in range(6)]
    errors: list[BaseException] = []

    def writer(data: bytes) -> None:
        try:
            for _ in range(40):
                atomic_write(path, data)
                assert path.read_bytes() in payloads  # never a torn or mixed file
        except BaseException as e:  # noqa: BLE001 - handed to the test's main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_bytes() in payloads
    assert not [p for p in tmp_path.iterdir() if is_temporary(p.name)]


def test_liveness_identity_and_stopped_state() -> None:
    child = subprocess.Popen(SLEEP)
    try:
        start = procs.start_ticks(child.pid)
        assert start is not None and procs.alive(child.pid) and procs.alive(child.pid, start)
        assert not procs.alive(child.pid, start + 1)  # the pid, but another process: not ours
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_until(lambda: procs.stopped(child.pid), 5, 0.01)
        assert procs.alive(child.pid)  # stopped is alive
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: procs.status(child.pid) == "zombie", 5, 0.01)
        assert not procs.alive(child.pid)  # exited, not yet reaped: gone for our purposes
    finally:
        child.kill()
        child.wait()
    assert not procs.alive(child.pid) and procs.status(child.pid) is None
    assert procs.start_ticks(child.pid) is None


def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    """die_with_parent: the parent is SIGKILLed (no cleanup of its own) and its child follows."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, subprocess, sys, time; from petctl.io.procs import die_with_parent; "
         f"c = subprocess.Popen({SLEEP!r}, preexec_fn=die_with_parent(signal.SIGTERM)); "
         "print(c.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert procs.alive(child_pid)
    parent.kill()
    parent.wait()
    assert wait_until(lambda: not procs.alive(child_pid), 5, 0.02)


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert free_port("") > 0  # every interface (a master port other nodes connect to)


def test_wait_until_polls_at_a_fixed_interval_and_reports_the_last_value() -> None:
    calls: list[float] = []

    def check() -> int:
        calls.append(time.monotonic())
        return len(calls) if len(calls) >= 4 else 0

    assert wait_until(check, 5, 0.02) == 4
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert all(0.015 < g < 0.5 for g in gaps)  # fixed, not backed off
    calls.clear()
    t0 = time.monotonic()
    assert wait_until(lambda: calls.append(1) or 0, 0.2, 0.05) == 0  # the last (false) value
    assert 0.2 <= time.monotonic() - t0 < 1.0 and 3 <= len(calls) <= 7
    with pytest.raises(ZeroDivisionError):  # a failure is not retried
        wait_until(lambda: 1 / 0, 5, 0.01)


class _Answer(http.server.BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass  # quiet: the test output is the assertions


def test_etcd_health_needs_etcd_itself(etcd_server) -> None:
    assert etcd_healthy(etcd_server.endpoint) and etcd_server.healthy()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)  # answers 200 to anything
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert not etcd_healthy(f"http://127.0.0.1:{server.server_address[1]}")  # a proxy, not etcd
    finally:
        server.shutdown()
        server.server_close()
    assert not etcd_healthy(f"http://127.0.0.1:{free_port()}", timeout=0.5)  # nobody there
    assert not etcd_healthy("not a url")
