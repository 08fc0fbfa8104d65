"""io/threads.Service: the start and stop every background loop of the agent shares."""

from __future__ import annotations

import threading
import time

from petctl.io.threads import Service


def test_a_service_runs_until_stopped_and_can_start_again():
    ticks: list[float] = []

    def loop() -> None:
        while not service.stopping.wait(0.01):
            ticks.append(time.monotonic())

    service = Service("ticker", loop)
    assert service.start() and not service.start()  # a second start while started does nothing
    time.sleep(0.1)
    assert service.running and len(ticks) >= 2
    assert service.stop(timeout=2.0) and not service.running and not service.started
    count = len(ticks)
    time.sleep(0.05)
    assert len(ticks) == count  # stopped means no more ticks
    assert service.start() and service.stop(timeout=2.0)  # and a stopped one starts again


def test_a_loop_that_stops_itself_does_not_join_itself():
    done = threading.Event()

    def loop() -> None:
        done.set() if service.stop(timeout=5.0) else None

    service = Service("self-stopper", loop)
    service.start()
    assert done.wait(2.0)


def test_a_loop_that_ignores_the_stop_is_reported_not_waited_for_forever():
    release = threading.Event()
    service = Service("stubborn", lambda: release.wait(10))
    service.start()
    t0 = time.monotonic()
    assert service.stop(timeout=0.2) is False  # the caller hears it still runs
    assert time.monotonic() - t0 < 2.0
    release.set()


def test_arguments_reach_the_loop():
    got: list[tuple] = []
    service = Service("args", lambda a, b: got.append((a, b)))
    service.start(1, "x")
    service.stop(timeout=2.0)
    assert got == [(1, "x")]
