"""Replaying a spot trace against one system's nodes: the benchmark plays the spot market and the ASG.

The plan (petctl.core.spottrace.plan) is pure; this is its I/O. Per action:
- notice: petctl's node gets `{"kind": "spot", "time": now + grace}` from the local metadata endpoint;
  torchrun's node gets nothing (torchrun reads no notice). At `time` the node is reclaimed: petctl's
  SIGKILLed, torchrun's SIGTERMed (the OS shutting down, as a spot reclaim does) and SIGKILLed 3 s later.
- rebalance: petctl's node gets `{"kind": "rebalance"}` (its job checkpoints); the notice follows.
- kill (a loss without notice): SIGKILL of the node's whole session, for both systems.
- hold: no launch until capacity returns.
A node that is gone is replaced like an ASG would: launched (billed) once capacity allows, its process
started `boot_s` later (the boot: OS, image, agent install; a replay parameter). Slots map to the live
nodes in launch order; torchrun's c10d store host (its first node) is never picked except by an outage,
which takes every node: the torchrun job is then started afresh (a new store) once capacity returns.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import Node
from petctl.core.spottrace import Action, Trace, due, pick_slot, plan

TICK = 0.1


@dataclass
class Billed:
    """One instance's life: billed from `launched`, its process from `started`, gone at `ended`."""

    name: str
    launched: float
    started: float
    ended: float | None = None
    why: str = ""


@dataclass
class Fleet:
    """The nodes of one system. `start(name)` starts a node process; `notices` is where petctl's metadata
    endpoint reads notices (None for torchrun); `protected` names a node only an outage may take."""

    system: str
    start: Callable[[], Node]
    notices: Path | None
    restart_job: Callable[[], None] | None = None  # torchrun: a fresh job after every node is gone
    nodes: dict[str, Node] = field(default_factory=dict)
    billed: dict[str, Billed] = field(default_factory=dict)
    protected: str | None = None

    def launch(self, launched: float) -> str:
        node = self.start()
        self.nodes[node.name] = node
        self.billed[node.name] = Billed(node.name, launched, time.time())
        return node.name

    def live(self) -> list[str]:
        return [n for n, node in self.nodes.items() if node.alive and self.billed[n].ended is None]

    def notice(self, name: str, grace: float, kind: str = "spot") -> None:
        if self.notices is None:
            return
        path = self.notices / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        body: dict[str, Any] = {"kind": kind, "time": time.time() + grace}
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)

    def remove(self, name: str, why: str, graceful: bool) -> None:
        node = self.nodes[name]
        if graceful and self.notices is None:  # torchrun: the OS shuts down (SIGTERM), then the host goes
            node.signal(signal.SIGTERM)
            deadline = time.monotonic() + 3.0
            while node.alive and time.monotonic() < deadline:
                time.sleep(0.05)
        node.kill()
        b = self.billed[name]
        b.ended, b.why = b.ended or time.time(), why

    def close_billing(self, now: float) -> None:
        for name, b in self.billed.items():
            if b.ended is None:
                b.ended = now if self.nodes[name].alive else now
                b.why = b.why or "end of replay"


@dataclass
class ReplayLog:
    t0: float = 0.0
    actions: list[dict[str, Any]] = field(default_factory=list)
    launches: list[dict[str, Any]] = field(default_factory=list)  # replacements: {launched, started}


def replay(trace: Trace, fleet: Fleet, boot_s: float, stop: Callable[[], bool] = lambda: False) -> ReplayLog:
    """Run the trace against `fleet` (already at full size, training); returns what was done when."""
    actions = plan(trace)
    log = ReplayLog(t0=time.time())
    done = 0
    hold_until = 0.0  # replay seconds
    reclaims: list[tuple[float, str, int]] = []  # (replay s, node, event)
    pending: list[float] = []  # replay seconds at which a replacement is launched
    booting: list[tuple[float, int]] = []  # (replay s its process starts, index in log.launches)
    target: dict[int, str] = {}  # event -> node it went to (a rebalance's notice follows it)
    end = trace.replay_seconds()
    while not stop():
        now = time.time() - log.t0
        if now >= end:
            break
        batch, done = due(actions, done, now)
        for a in batch:
            hold_until = _act(a, fleet, now, hold_until, reclaims, pending, target, log)
        for item in [r for r in reclaims if r[0] <= now]:
            reclaims.remove(item)
            if fleet.billed[item[1]].ended is None:
                fleet.remove(item[1], "reclaimed", graceful=True)
                pending.append(now)
        for at in sorted(pending):
            if at <= now and now >= hold_until:  # capacity allows: the ASG launches (billing starts)
                pending.remove(at)
                log.launches.append({"launched": now, "lost_at": at})
                booting.append((now + boot_s, len(log.launches) - 1))
        for item in [b for b in booting if b[0] <= now]:  # booted: the agent (or torchrun) starts
            booting.remove(item)
            if not fleet.live() and fleet.restart_job is not None:
                fleet.restart_job()  # torchrun after an outage: a fresh store on a fresh first node
            entry = log.launches[item[1]]
            entry.update(node=fleet.launch(log.t0 + entry["launched"]), started=round(now, 2))
        time.sleep(TICK)
    fleet.close_billing(time.time())
    return log


def _act(a: Action, fleet: Fleet, now: float, hold_until: float, reclaims: list, pending: list,
         target: dict[int, str], log: ReplayLog) -> float:
    record: dict[str, Any] = {"at": round(now, 2), "what": a.what, "event": a.event}
    if a.what == "hold":
        hold_until = max(hold_until, a.until)
        record["until"] = a.until
    elif a.node is None:  # an outage: every node gets the notice
        names = fleet.live()
        for name in names:
            fleet.notice(name, a.grace)
            reclaims.append((now + a.grace, name, a.event))
        record["nodes"] = names
    else:
        name = target.get(a.event) if a.what == "notice" and a.event in target else None
        if name is None or fleet.billed[name].ended is not None:
            eligible = [n for n in fleet.live() if n != fleet.protected
                        and not any(r[1] == n for r in reclaims)]
            name = pick_slot(a.node, eligible)
        if name is None:
            record["skipped"] = "no eligible node"
        elif a.what == "kill":
            fleet.remove(name, "lost without notice", graceful=False)
            pending.append(now)
        elif a.what == "rebalance":
            fleet.notice(name, 0.0, kind="rebalance")
            target[a.event] = name
        else:
            fleet.notice(name, a.grace)
            reclaims.append((now + a.grace, name, a.event))
        record["node"] = name
    log.actions.append(record)
    return hold_until
