"""Replaying a spot trace against one system's nodes: the benchmark plays the spot market and the ASG.

The plan (petctl.core.spottrace.plan) is pure; this is its I/O. Per action:
- notice: petctl's node gets `{"kind": "spot", "time": now + grace}` from the local metadata endpoint;
  torchrun's node gets nothing (torchrun reads no notice). At `time` the node is reclaimed: petctl's
  SIGKILLed, torchrun's SIGTERMed (the OS shutting down, as a spot reclaim does) and SIGKILLed 3 s later
  (without holding up the replay's clock).
- rebalance: petctl's node gets `{"kind": "rebalance"}` (its job checkpoints); the notice follows.
- kill (a loss without notice): SIGKILL of the node's whole session, for both systems.
- hold: no launch until capacity returns.

The group. A node that is gone is replaced like an ASG would: launched (billed) once capacity allows,
its process started `boot_s` later (the boot: OS, image, agent install; the caller passes the boot
compressed by the trace's time scale, B / S). An agent that detaches its instance at a spot notice
(petctl: its real call, `POST latest/petctl/detach` on the local metadata endpoint, which hands it to
`Fleet.request_detach`; the group keeps its desired capacity) gets the replacement launched when the
call comes, not at the reclaim; the detached instance is then no longer the group's and is billed until
it ends itself (its process exits: the agent ends its instance after the
hand-off) or is reclaimed, whichever comes first. Every other instance is billed from its launch until
it is reclaimed, lost or the replay ends: an agent that exits on its own leaves its instance running.
The fleet records each instance's life as events (`instance.launched` with `boot_s`, `instance.booted`,
`instance.detached`, `instance.reclaimed`, `instance.lost`, `instance.terminated`), the names the local
reconciler uses; bench/traceaccount.py bills from them.

Slots map to the live nodes in launch order; torchrun's c10d store host (its first node) is never
picked except by an outage, which takes every node: the torchrun job is then started afresh (a new
store) once capacity returns.

Schedule. Every action, reclaim, launch and boot records when it was due and how late it fired
(`ReplayLog.max_late_s`). A replay more than LATE_LIMIT_S behind its schedule did not replay the trace
(a loaded machine): its figures are marked invalid.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import Node
from petctl.core.spottrace import Action, Trace, due, pick_slot, plan

TICK = 0.1
LATE_LIMIT_S = 1.0  # a replay whose actions fired later than this behind the trace's schedule is invalid
SHUTDOWN_S = 3.0  # torchrun's reclaim: SIGTERM, then SIGKILL this much later


@dataclass
class Billed:
    """One instance's life: billed from `launched`, its process from `started` (None: never booted),
    gone at `ended`; `detached` when it left its group (a spot notice under petctl)."""

    name: str
    launched: float
    started: float | None
    ended: float | None = None
    why: str = ""
    detached: float | None = None

    def events(self) -> list[dict[str, Any]]:
        """This life as the reconciler's instance events (unix seconds)."""
        boot = None if self.started is None else round(self.started - self.launched, 3)
        out: list[dict[str, Any]] = [{"ts": self.launched, "event": "instance.launched",
                                      "instance": self.name, "boot_s": boot}]
        if self.started is not None:
            out.append({"ts": self.started, "event": "instance.booted", "instance": self.name})
        if self.detached is not None:
            out.append({"ts": self.detached, "event": "instance.detached", "instance": self.name})
        if self.ended is not None:
            kind = {"reclaimed": "instance.reclaimed", "lost without notice": "instance.lost"}.get(
                self.why, "instance.terminated")
            out.append({"ts": self.ended, "event": kind, "instance": self.name, "why": self.why})
        return out


@dataclass
class Fleet:
    """The nodes of one system. `start(name)` starts a node process; `notices` is where petctl's metadata
    endpoint reads notices (None for torchrun); `protected` names a node only an outage may take;
    `request_detach(name)`: an agent takes its instance out of the group (the metadata endpoint's
    `on_detach`, called on the server's thread); the replay launches the replacement on its next tick."""

    system: str
    start: Callable[[], Node]
    notices: Path | None
    restart_job: Callable[[], None] | None = None  # torchrun: a fresh job after every node is gone
    detach_requests: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # (name, ts)
    nodes: dict[str, Node] = field(default_factory=dict)
    billed: dict[str, Billed] = field(default_factory=dict)
    protected: str | None = None
    dying: dict[str, float] = field(default_factory=dict)  # node -> when its SIGKILL is due (monotonic)

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

    def detach(self, name: str, now: float) -> None:
        self.billed[name].detached = now

    def request_detach(self, name: str) -> bool:
        """An agent asks to leave the group (any thread): True when `name` is one of this fleet's live
        instances, or already detached (the call is idempotent, as AWS's answer to a repeat is)."""
        b = self.billed.get(name)
        if b is None or b.ended is not None:
            return False
        if b.detached is None:
            self.detach_requests.put((name, time.time()))
        return True

    def take_detaches(self) -> list[tuple[str, float]]:
        """The detach requests since the last call, each instance once, in arrival order."""
        out: list[tuple[str, float]] = []
        while True:
            try:
                name, ts = self.detach_requests.get_nowait()
            except queue.Empty:
                return out
            if self.billed[name].detached is None and all(name != n for n, _ in out):
                out.append((name, ts))

    def remove(self, name: str, why: str, graceful: bool) -> None:
        """The instance is gone now (billing ends); torchrun's node is shut down (SIGTERM, SIGKILL
        SHUTDOWN_S later, in `reap`), any other killed at once."""
        node = self.nodes[name]
        b = self.billed[name]
        b.ended, b.why = b.ended or time.time(), b.why or why
        if graceful and self.notices is None:  # torchrun: the OS shuts down (SIGTERM), then the host goes
            node.signal(signal.SIGTERM)
            self.dying[name] = time.monotonic() + SHUTDOWN_S
            return
        node.kill()

    def reap(self) -> None:
        """SIGKILL the shut-down nodes whose time is up; end the billing of a detached instance whose
        agent has exited (it ended its instance)."""
        now = time.monotonic()
        for name, at in list(self.dying.items()):
            if now >= at or not self.nodes[name].alive:
                self.nodes[name].kill()
                del self.dying[name]
        for name, b in self.billed.items():
            gone = name in self.nodes and not self.nodes[name].alive
            if b.detached is not None and b.ended is None and gone:
                b.ended, b.why = time.time(), "self-terminated"

    def close_billing(self, now: float) -> None:
        for b in self.billed.values():
            if b.ended is None:
                b.ended, b.why = now, b.why or "end of replay"
        for name in list(self.dying):
            self.nodes[name].kill()
            del self.dying[name]

    def instance_events(self) -> list[dict[str, Any]]:
        return sorted((e for b in self.billed.values() for e in b.events()), key=lambda e: e["ts"])


@dataclass
class ReplayLog:
    t0: float = 0.0
    boot_s: float = 0.0  # replayed seconds from a launch to its node's start
    actions: list[dict[str, Any]] = field(default_factory=list)
    launches: list[dict[str, Any]] = field(default_factory=list)  # replacements: {launched, started}
    late: list[dict[str, Any]] = field(default_factory=list)  # what fired over LATE_LIMIT_S late
    max_late_s: float = 0.0

    def fired(self, what: str, due_at: float, now: float) -> float:
        late = max(0.0, now - due_at)
        self.max_late_s = max(self.max_late_s, late)
        if late > LATE_LIMIT_S:
            self.late.append({"what": what, "due": round(due_at, 2), "at": round(now, 2)})
        return round(late, 3)

    @property
    def valid(self) -> bool:
        return self.max_late_s <= LATE_LIMIT_S


def replay(trace: Trace, fleet: Fleet, boot_s: float, stop: Callable[[], bool] = lambda: False) -> ReplayLog:
    """Run the trace against `fleet` (already at full size, training); returns what was done when.
    `boot_s`: replayed seconds from a replacement's launch to its node's start (the boot / time_scale)."""
    actions = plan(trace)
    log = ReplayLog(t0=time.time(), boot_s=boot_s)
    done = 0
    hold_until = 0.0  # replay seconds
    reclaims: list[tuple[float, str, int]] = []  # (replay s, node, event)
    pending: list[float] = []  # replay seconds from which a replacement is to be launched
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
        for name, ts in fleet.take_detaches():  # the group launches a detached instance's replacement now
            fleet.detach(name, ts)
            pending.append(now)
        for item in [r for r in reclaims if r[0] <= now]:
            reclaims.remove(item)
            b = fleet.billed[item[1]]
            if b.ended is None:
                log.fired("reclaim", item[0], now)
                fleet.remove(item[1], "reclaimed", graceful=True)
                if b.detached is None:  # a detached instance was replaced at its notice
                    pending.append(now)
        fleet.reap()
        for at in sorted(pending):
            if at <= now and now >= hold_until:  # capacity allows: the ASG launches (billing starts)
                pending.remove(at)
                log.launches.append({"launched": now, "lost_at": at,
                                     "late_s": log.fired("launch", max(at, hold_until), now)})
                booting.append((now + boot_s, len(log.launches) - 1))
        for item in [b for b in booting if b[0] <= now]:  # booted: the agent (or torchrun) starts
            booting.remove(item)
            if not fleet.live() and fleet.restart_job is not None:
                fleet.restart_job()  # torchrun after an outage: a fresh store on a fresh first node
            entry = log.launches[item[1]]
            entry.update(node=fleet.launch(log.t0 + entry["launched"]), started=round(now, 2),
                         boot_late_s=log.fired("boot", item[0], now))
        time.sleep(TICK)
    now = time.time()
    for _at, index in booting:  # launched, still booting at the end: billed all the same
        entry = log.launches[index]
        name = f"booting-{index}"
        fleet.billed[name] = Billed(name, log.t0 + entry["launched"], None)
        entry["node"] = name
    fleet.reap()
    fleet.close_billing(now)
    return log


def _act(a: Action, fleet: Fleet, now: float, hold_until: float, reclaims: list, pending: list,
         target: dict[int, str], log: ReplayLog) -> float:
    record: dict[str, Any] = {"at": round(now, 2), "due": round(a.at, 2), "what": a.what, "event": a.event,
                              "late_s": log.fired(a.what, a.at, now)}
    if a.what == "hold":
        hold_until = max(hold_until, a.until)
        record["until"] = a.until
    elif a.node is None:  # an outage: every node gets the notice
        names = fleet.live()
        for name in names:
            _notice(fleet, name, a.grace, now, reclaims, pending, a.event)
        record["nodes"] = names
    else:
        name = target.get(a.event) if a.what == "notice" and a.event in target else None
        if name is None or fleet.billed[name].ended is not None:
            eligible = [n for n in fleet.live() if n != fleet.protected
                        and not any(r[1] == n for r in reclaims) and fleet.billed[n].detached is None]
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
            _notice(fleet, name, a.grace, now, reclaims, pending, a.event)
        record["node"] = name
    log.actions.append(record)
    return hold_until


def _notice(fleet: Fleet, name: str, grace: float, now: float, reclaims: list, pending: list,
            event: int) -> None:
    fleet.notice(name, grace)
    reclaims.append((now + grace, name, event))
