"""The warm pool's refill report: it gives up only when every worker it started died importing.

A round that takes a still-importing worker from the pool while the refill report waits is not a death:
it used to read as one (the pool looked empty), so the pool gave up and every later restart went cold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from petctl.agent.workers import _Readiness, _report_warm
from petctl.io.eventlog import EventLog


@dataclass
class FakeProc:
    pid: int


@dataclass
class FakePool:
    """The part of WarmPool the report reads; `on_wait` plays what happens while it waits."""

    handshakes: dict[int, _Readiness]
    ready: list[FakeProc] = field(default_factory=list)
    closed: bool = False
    given_up: bool = False
    on_wait: object = None

    def readiness(self, proc: FakeProc) -> _Readiness | None:
        return self.handshakes.get(proc.pid)

    def wait_ready(self, timeout: float) -> int:
        if callable(self.on_wait):
            self.on_wait(self)
        return sum(1 for p in self.ready if self.handshakes[p.pid].ready)


def _events() -> tuple[EventLog, list[dict]]:
    seen: list[dict] = []
    log = EventLog("test")
    log.add_sink(seen.append)
    return log, seen


def test_a_worker_taken_by_a_round_while_importing_is_not_a_death():
    shake = _Readiness()

    def round_takes_it(pool: FakePool) -> None:
        pool.ready.clear()  # take(): handed to the round, still importing
        shake.ready = True
        shake.settled.set()

    pool = FakePool({1: shake}, [FakeProc(1)], on_wait=round_takes_it)
    log, seen = _events()
    _report_warm(pool, 3, log)
    assert not pool.given_up
    assert [e["event"] for e in seen] == ["workers.warm_ready"]


def test_every_worker_dying_at_import_gives_up_once():
    shakes = {1: _Readiness(), 2: _Readiness()}
    for s in shakes.values():
        s.settled.set()  # EOF on the pipe without the signal
    pool = FakePool(shakes, [FakeProc(1), FakeProc(2)])
    log, seen = _events()
    _report_warm(pool, 3, log)
    assert pool.given_up
    assert [e["event"] for e in seen] == ["workers.warm_ready", "workers.warm_given_up"]


def test_a_closed_pool_does_not_give_up():
    shake = _Readiness()
    shake.settled.set()
    pool = FakePool({1: shake}, [FakeProc(1)], closed=True)
    log, _ = _events()
    _report_warm(pool, 3, log)
    assert not pool.given_up
