"""bench/tracefleet.py, the bench's spot market and group, against fake nodes on a 4 s trace (issue 43): the
boot is replayed (B / S after the launch), petctl's replacement is launched at the notice and its
noticed instance is billed until it ends itself, torchrun's is replaced at the reclaim, every instance
is billed from its launch, and a replay that keeps to its schedule says so."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench import traceaccount as ta
from bench.tracefleet import Fleet, replay
from petctl.core.spottrace import Trace, TraceEvent

S = 10.0
BOOT = 10.0  # simulated seconds: 1 s replayed
# 3 nodes, 4 s of replay: a notice at 0.5 s (reclaim 2 s later, at 2.5 s), a silent loss at 1.5 s
TRACE = Trace("t", nodes=3, duration=40.0, time_scale=S,
              events=(TraceEvent(5.0, "notice", node=0, grace=20.0), TraceEvent(15.0, "loss", node=0)))


@dataclass
class FakeNode:
    name: str
    notices: Path | None
    exits_after_notice: float | None  # petctl's agent: ends its instance this long after its notice
    killed: bool = False
    signals: list[int] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        if self.killed:
            return False
        path = self.notices / f"{self.name}.json" if self.notices else None
        if self.exits_after_notice is not None and path is not None and path.exists():
            return time.time() < path.stat().st_mtime + self.exits_after_notice
        return True

    def kill(self) -> None:
        self.killed = True

    def signal(self, sig: int) -> None:
        self.signals.append(sig)

    def events(self, name: str | None = None, after: float | None = None) -> list[dict]:
        return []


class AgentsDetach(Fleet):
    """A fleet whose fake agents do what petctl's does at a spot notice: ask the group to detach them
    (on the metadata endpoint: `request_detach`, here called at once)."""

    def notice(self, name: str, grace: float, kind: str = "spot") -> None:
        super().notice(name, grace, kind)
        assert self.request_detach(name) and self.request_detach(name)  # a repeat is answered the same


def fleet(tmp_path: Path, petctl: bool) -> Fleet:
    notices = tmp_path / "notices" if petctl else None
    count = [0]

    def start() -> FakeNode:
        count[0] += 1
        return FakeNode(f"n{count[0]}", notices, 0.5 if petctl else None)

    f = (AgentsDetach if petctl else Fleet)("petctl" if petctl else "torchrun-c10d", start, notices=notices)
    t = time.time()
    for _ in range(3):
        f.launch(t)
    return f


def rel(events: list[dict], t0: float, kind: str, name: str) -> float:
    return next(e["ts"] - t0 for e in events if e["event"] == kind and e["instance"] == name)


@pytest.mark.timeout(60)
def test_petctl_replacement_launches_at_the_notice_and_the_leaver_is_billed_until_it_ends(tmp_path):
    f = fleet(tmp_path, petctl=True)
    log = replay(TRACE, f, BOOT / S)
    ev = f.instance_events()
    assert [a["what"] for a in log.actions] == ["notice", "kill"]
    noticed, lost = log.actions[0]["node"], log.actions[1]["node"]
    # the notice at 0.5 s: the instance detaches, its replacement is launched at once and boots 1 s later
    assert rel(ev, log.t0, "instance.detached", noticed) == pytest.approx(0.5, abs=0.3)
    first = log.launches[0]
    assert first["launched"] == pytest.approx(0.5, abs=0.3)
    assert first["started"] - first["launched"] == pytest.approx(1.0, abs=0.3)
    assert rel(ev, log.t0, "instance.booted", first["node"]) == pytest.approx(first["started"], abs=0.05)
    # its agent ended the instance 0.5 s after the notice: billing stops there, not at the reclaim (2.5 s)
    assert rel(ev, log.t0, "instance.terminated", noticed) == pytest.approx(1.0, abs=0.3)
    assert not any(e["event"] == "instance.reclaimed" for e in ev)
    # the silent loss at 1.5 s: billed until then, replaced then; nothing else was launched
    assert rel(ev, log.t0, "instance.lost", lost) == pytest.approx(1.5, abs=0.3)
    assert len(log.launches) == 2 and log.launches[1]["launched"] == pytest.approx(1.5, abs=0.3)
    assert log.valid and log.max_late_s < 0.5
    lives = {x.name: x for x in ta.lives_from_events(ev, end=log.t0 + 4.0)}
    assert len(lives) == 5  # 3 first nodes, 2 replacements, each billed from its launch
    assert lives[first["node"]].launched - log.t0 == pytest.approx(first["launched"], abs=0.05)


@pytest.mark.timeout(60)
def test_torchrun_is_replaced_at_the_reclaim_and_shut_down_without_holding_the_clock(tmp_path):
    f = fleet(tmp_path, petctl=False)
    log = replay(TRACE, f, BOOT / S)
    ev = f.instance_events()
    noticed = log.actions[0]["node"]
    # torchrun hears no notice: it trains until the reclaim at 2.5 s, is SIGTERMed then, and replaced then
    assert rel(ev, log.t0, "instance.reclaimed", noticed) == pytest.approx(2.5, abs=0.3)
    assert signal.SIGTERM in f.nodes[noticed].signals and f.nodes[noticed].killed
    launched = sorted(x["launched"] for x in log.launches)
    assert launched == [pytest.approx(1.5, abs=0.3), pytest.approx(2.5, abs=0.3)]
    # the replacement for the reclaim boots at 3.5 s, within the replay (the 3 s shutdown held nothing up)
    assert all(x.get("started") for x in log.launches)
    assert log.valid


@pytest.mark.timeout(60)
def test_a_launch_still_booting_at_the_end_is_billed(tmp_path):
    f = fleet(tmp_path, petctl=False)
    log = replay(TRACE, f, 3.0)  # a 30 s boot: neither replacement (1.5 s, 2.5 s) is up by the end, 4 s
    booting = [x for x in log.launches if x["node"].startswith("booting-")]
    assert len(booting) == 2
    lives = {x.name: x for x in ta.lives_from_events(f.instance_events(), end=log.t0 + 4.0)}
    for entry, launched in zip(booting, (1.5, 2.5), strict=True):
        life = lives[entry["node"]]
        assert life.booted is None
        assert life.ended - log.t0 == pytest.approx(4.0, abs=0.3)
        assert life.launched - log.t0 == pytest.approx(launched, abs=0.3)
