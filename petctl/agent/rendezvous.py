"""petctl's own rendezvous over etcd v2: barrier, rank assignment, world size in [min, max].

Why not torchrun's etcd backends: one agent failure closes their rendezvous for good, and a host that
vanishes without closing its sockets is noticed only when a collective times out. Here liveness is a TTL
key per node (see heartbeat.py), every round is one JSON value changed only by compare-and-swap, and a
round can always be replaced by the next one, so no single failure wedges the job.

Protocol (docs/ARCHITECTURE.md has the key layout):
- `live/round` phase `joining`: each node writes one join record `rounds/<n>/<node>`. The *closer* is the
  lowest-sorted live joiner (previous rank first, so rank 0 stays rank 0, then join order). It freezes
  the round (CAS) once >= min have joined and either every live node has joined, max is reached, or
  `last_call` has passed since min was reached. Joiners beyond max wait for a later round.
- phase `frozen`: the barrier is passed; `ranks` maps node -> rank. A live node outside `ranks` waits;
  members start round n+1 when it can be admitted (see agent.py).
- phase `final`: the job is over (`result` holds why).
etcd requests per node per round are bounded: one join write, at most one CAS to open a round, the
closer's CAS to freeze it, plus reads on wake-ups. Only the closer wakes for each arrival; the other
joiners pause their membership watch (see LiveWatcher), so what a node pays does not grow with N.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import etcd

from petctl.core.eventlog import EventLog
from petctl.core.keys import JobKeys
from petctl.core.spec import Timeouts
from petctl.jobstate import write_result

JOIN_RECORD_TTL = 3600  # join records outlive any round; old round dirs are also deleted by closers


class JobEnded(Exception):
    """The round went `final`: the job succeeded, failed or was killed."""

    def __init__(self, round_value: dict[str, Any]):
        super().__init__(round_value.get("reason", ""))
        self.state = str(round_value.get("state", "unknown"))
        self.reason = str(round_value.get("reason", ""))


class RendezvousAborted(Exception):
    """The caller asked to stop waiting (graceful leave, or our heartbeat was lost)."""


@dataclass
class RoundInfo:
    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    ranks: dict[str, int]
    restarts: int
    cause: str
    started: float  # when this round was opened (for recovery timing)


@dataclass
class Snapshot:
    """The `live/` prefix as of one etcd index."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    round: dict[str, Any] | None = None
    round_index: int | None = None
    done: dict[int, set[str]] = field(default_factory=dict)
    etcd_index: int = 0


@dataclass
class RequestStats:
    """etcd requests this agent made, by kind: the benchmark reports them per node per round."""

    reads: int = 0
    writes: int = 0
    watches: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"reads": self.reads, "writes": self.writes, "watches": self.watches}


def pick_free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LiveWatcher:
    """Long-polls `live/` and sets `changed` on every event there.

    The agent never acts on the event itself: it re-reads a snapshot, so a missed or coalesced event
    (history compaction, reconnects) cannot leave it with a stale view.

    Two threads: one on `live/round` (always on: round changes are what every node waits for) and one
    on the rest of `live/`, which a node may `pause()` while it only waits for the round to freeze.
    Why: at job start every instance's heartbeat appears in `live/nodes`; if all N agents woke for each
    of them, per-node requests would grow with N. Paused, an event costs only the closer a wake-up.
    """

    def __init__(self, client: etcd.Client, prefix: str, stats: RequestStats, poll_timeout: float = 10.0):
        self.client = client
        self.prefix = prefix
        self.stats = stats
        self.poll_timeout = poll_timeout
        self.changed = threading.Event()
        self._stop = threading.Event()
        self._active = threading.Event()  # clear = the membership watch is paused
        self._active.set()
        self._threads = [
            threading.Thread(target=self._run, args=(f"{prefix}/round", False, None), name="round-watch",
                             daemon=True),
            threading.Thread(target=self._run, args=(prefix, True, self._active), name="live-watch",
                             daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self._active.set()

    def pause(self) -> None:
        """Stop waking on membership events (the round watch stays on). Idempotent."""
        self._active.clear()

    def resume(self) -> None:
        """Watch membership again; the first thing it does is wake the agent for a fresh snapshot."""
        if not self._active.is_set():
            self._active.set()

    def _run(self, key: str, recursive: bool, gate: threading.Event | None) -> None:
        index: int | None = None
        while not self._stop.is_set():
            if gate is not None and not gate.is_set():
                index = None  # events while paused are skipped: resuming starts from a fresh read
                gate.wait(1.0)
                continue
            try:
                if index is None:
                    # Only the current etcd index is needed: a non-recursive read of the dir is O(1).
                    self.stats.reads += 1
                    index = self.client.read(self.prefix).etcd_index + 1
                    self.changed.set()
                    continue
                self.stats.watches += 1
                r = self.client.read(key, wait=True, recursive=recursive, waitIndex=index,
                                     timeout=self.poll_timeout)
                index = max(index, r.modifiedIndex + 1)
                if gate is None or gate.is_set():
                    self.changed.set()
            except etcd.EtcdWatchTimedOut:
                continue
            except etcd.EtcdEventIndexCleared:
                index = None
            except Exception:
                index = None
                self._stop.wait(0.2)

    def wait(self, timeout: float) -> bool:
        fired = self.changed.wait(timeout)
        self.changed.clear()
        return fired


class EtcdRendezvous:
    def __init__(self, client: etcd.Client, job: str, node_id: str, host_addr: str, min_nodes: int,
                 max_nodes: int, max_restarts: int, timeouts: Timeouts, events: EventLog,
                 watcher: LiveWatcher, stats: RequestStats, initial_size: int | None = None) -> None:
        self.client = client
        self.keys = JobKeys(job)
        self.job = job
        self.node_id = node_id
        self.host_addr = host_addr
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.max_restarts = max_restarts
        self.initial_size = min(max_nodes, max(min_nodes, initial_size or min_nodes))
        self.t = timeouts
        self.events = events
        self.watcher = watcher
        self.stats = stats
        self.on_result: Callable[[str, str, int | None], None] | None = None

    # --- reading -----------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        self.stats.reads += 1
        snap = Snapshot()
        try:
            r = self.client.read(self.keys.live, recursive=True)
        except etcd.EtcdKeyNotFound:
            return snap
        snap.etcd_index = r.etcd_index
        nodes_prefix, done_prefix = self.keys.nodes + "/", self.keys.live + "/done/"
        for leaf in r.leaves:
            if leaf.dir:
                continue
            if leaf.key.startswith(nodes_prefix):
                snap.nodes[leaf.key[len(nodes_prefix):]] = _loads(leaf.value)
            elif leaf.key == self.keys.round:
                snap.round = _loads(leaf.value)
                snap.round_index = leaf.modifiedIndex
            elif leaf.key.startswith(done_prefix):
                round_no, node = leaf.key[len(done_prefix):].split("/", 1)
                snap.done.setdefault(int(round_no), set()).add(node)
        return snap

    def _members(self, round_no: int) -> dict[str, tuple[dict[str, Any], int]]:
        self.stats.reads += 1
        try:
            r = self.client.read(self.keys.round_members(round_no), recursive=True)
        except etcd.EtcdKeyNotFound:
            return {}
        return {leaf.key.rsplit("/", 1)[1]: (_loads(leaf.value), leaf.createdIndex)
                for leaf in r.leaves if not leaf.dir}

    # --- writing -----------------------------------------------------------------------------------
    def _cas_round(self, value: dict[str, Any], prev_index: int) -> bool:
        self.stats.writes += 1
        try:
            self.client.write(self.keys.round, json.dumps(value), prevIndex=prev_index)
            return True
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            return False

    def open_first_round(self) -> None:
        self.stats.writes += 1
        value = {"round": 1, "phase": "joining", "restarts": 0, "cause": "job start", "ts": time.time(),
                 "preempt": None}
        try:
            self.client.write(self.keys.round, json.dumps(value), prevExist=False)
        except etcd.EtcdAlreadyExist:
            pass

    def start_round(self, snap: Snapshot, cause: str, failure: bool = False) -> bool:
        """Replace the current round with round n+1 (joining). False if someone else moved it first.

        A worker failure counts against max_restarts; past it the job ends failed instead.
        """
        current = snap.round
        if current is None or snap.round_index is None or current.get("phase") == "final":
            return False
        restarts = int(current.get("restarts", 0)) + (1 if failure else 0)
        if failure and restarts > self.max_restarts:
            self.end_job("failed", f"{cause}; max_restarts={self.max_restarts} exhausted",
                         int(current["round"]))
            return True
        value = {"round": int(current["round"]) + 1, "phase": "joining", "restarts": restarts, "cause": cause,
                 "ts": time.time(), "preempt": None}
        ok = self._cas_round(value, snap.round_index)
        if ok:
            self.events.emit("rendezvous.restart", round=value["round"], cause=cause, failure=failure,
                             restarts=restarts)
        return ok

    def set_preempt(self, snap: Snapshot, deadline: float) -> bool:
        if snap.round is None or snap.round_index is None:
            return False
        value = dict(snap.round, preempt={"node_id": self.node_id, "deadline": deadline})
        return self._cas_round(value, snap.round_index)

    def mark_done(self, round_no: int) -> None:
        self.stats.writes += 1
        self.client.write(f"{self.keys.done(round_no)}/{self.node_id}", json.dumps({"ts": time.time()}),
                          ttl=JOIN_RECORD_TTL)

    def end_job(self, state: str, reason: str, round_no: int | None) -> bool:
        """Record the final result; True for the one agent whose write it was (it releases capacity)."""
        self.stats.writes += 2
        if write_result(self.client, self.job, state, reason, round_no):
            self.events.emit("job.result", state=state, reason=reason, round=round_no)
            if self.on_result is not None:
                self.on_result(state, reason, round_no)
            return True
        return False

    # --- the rendezvous ----------------------------------------------------------------------------
    def next_rendezvous(self, prev_rank: int | None, should_abort: Callable[[], bool],
                        on_state: Callable[[str], None] | None = None) -> RoundInfo:
        """Block until a round that includes this node is frozen; return our place in it.

        Only the closer watches arrivals; the others pause the membership watch once they have joined
        and wake for round changes and once a second, re-reading the join records only when a node
        ranked ahead of them is gone (only that can make one of them the closer). So what each node
        pays per round does not grow with N.
        """
        try:
            return self._next_rendezvous(prev_rank, should_abort, on_state)
        finally:
            self.watcher.resume()

    def _next_rendezvous(self, prev_rank: int | None, should_abort: Callable[[], bool],
                         on_state: Callable[[str], None] | None) -> RoundInfo:
        joined_round: int | None = None
        members_round: int | None = None
        ahead: set[str] = set()
        order: list[str] = []
        live: dict[str, tuple[dict[str, Any], int]] = {}
        below_min_since: float | None = None
        min_reached_at: float | None = None
        waiting_reported = False
        t_start = time.monotonic()
        while True:
            if should_abort():
                raise RendezvousAborted()
            snap = self.snapshot()
            rnd = snap.round
            if rnd is None:
                self.open_first_round()
                continue
            if rnd.get("phase") == "final":
                raise JobEnded(rnd)
            round_no = int(rnd["round"])
            alive = set(snap.nodes)
            now = time.monotonic()
            if len(alive) < self.min_nodes:
                below_min_since = below_min_since or now
                if now - below_min_since > self.t.join_timeout:
                    self.end_job("failed", f"fewer than min={self.min_nodes} nodes for "
                                 f"{self.t.join_timeout:.0f}s", round_no)
                    continue
            else:
                below_min_since = None

            timeout = 1.0
            if rnd.get("phase") == "joining":
                if joined_round != round_no:
                    self._join(round_no, prev_rank)
                    joined_round, min_reached_at, members_round = round_no, None, None
                    if on_state:
                        on_state("joining")
                if members_round != round_no or not ahead or not ahead <= alive:
                    members = self._members(round_no)
                    members_round = round_no
                    live = {n: m for n, m in members.items() if n in alive}
                    if self.node_id not in live:  # our record vanished (should not happen): write it again
                        joined_round = None
                        continue
                    order = sorted(live, key=lambda n: _sort_key(live[n]))
                    ahead = set(order[: order.index(self.node_id)])
                if ahead:  # not the closer: only a round change or a departure ahead of us matters
                    self.watcher.pause()
                else:
                    self.watcher.resume()
                    timeout = self._close(snap, rnd, order, live, alive, now, min_reached_at)
                    if timeout is None:
                        continue  # frozen by us
                    if len(order[: self.max_nodes]) >= self.min_nodes:
                        min_reached_at = min_reached_at or now
            else:
                self.watcher.resume()
            if rnd.get("phase") == "frozen":
                ranks = {k: int(v) for k, v in (rnd.get("ranks") or {}).items()}
                if self.node_id in ranks:
                    info = RoundInfo(round=round_no, rank=ranks[self.node_id], world_size=len(ranks),
                                     master_addr=str(rnd["master_addr"]), master_port=int(rnd["master_port"]),
                                     ranks=ranks, restarts=int(rnd.get("restarts", 0)),
                                     cause=str(rnd.get("cause", "")), started=float(rnd.get("ts", 0.0)))
                    self.events.emit("rendezvous.complete", round=round_no, rank=info.rank,
                                     world_size=info.world_size, seconds=round(time.monotonic() - t_start, 3),
                                     cause=info.cause, requests=self.stats.as_dict())
                    return info
                # Not admitted. If every member is gone, nobody else will open the next round.
                if not any(n in alive for n in ranks):
                    self.start_round(snap, cause="all members of the previous round lost")
                    continue
                if not waiting_reported:
                    waiting_reported = True
                    self.events.emit("rendezvous.waiting", round=round_no, world_size=len(ranks))
                    if on_state:
                        on_state("waiting")
            self.watcher.wait(timeout)

    def _close(self, snap: Snapshot, rnd: dict[str, Any], order: list[str],
               live: dict[str, tuple[dict[str, Any], int]], alive: set[str], now: float,
               min_reached_at: float | None) -> float | None:
        """The closer's turn: freeze the round if it is ready (None), else how long to wait.

        It polls fast only while an alive node has not joined yet (its join write follows its
        heartbeat within milliseconds, and join records are outside the watched prefix); otherwise it
        sleeps until the next arrival or the end of `last_call` / `initial_wait`.
        """
        admitted = order[: self.max_nodes]
        pending = bool(alive - set(live))
        if len(admitted) < self.min_nodes:
            return 0.05 if pending else 1.0
        waited = now - (min_reached_at or now)
        if int(rnd["round"]) == 1 and len(live) < self.initial_size:
            # Job start: the other instances are still booting; wait for them (bounded) rather than
            # starting small and restarting as each one arrives.
            left = self.t.initial_wait - (time.time() - float(rnd.get("ts", time.time())))
            if left > 0:
                return 0.05 if pending else min(1.0, left)
        elif pending and len(live) < self.max_nodes and waited < self.t.last_call:
            return min(0.05, self.t.last_call - waited)
        if self._freeze(rnd, snap.round_index, admitted, live):
            return None
        return 0.05

    def _join(self, round_no: int, prev_rank: int | None) -> None:
        record = {"node_id": self.node_id, "addr": self.host_addr, "port": pick_free_port(),
                  "prev_rank": prev_rank, "ts": time.time()}
        self.stats.writes += 1
        self.client.write(self.keys.round_member(round_no, self.node_id), json.dumps(record),
                          ttl=JOIN_RECORD_TTL)
        self.events.emit("rendezvous.joined", round=round_no, prev_rank=prev_rank)

    def _freeze(self, rnd: dict[str, Any], index: int | None, admitted: list[str],
                live: dict[str, tuple[dict[str, Any], int]]) -> bool:
        if index is None:
            return False
        ranks = {n: i for i, n in enumerate(admitted)}
        master = live[admitted[0]][0]
        value = dict(rnd, phase="frozen", ranks=ranks, world_size=len(ranks), master_addr=master["addr"],
                     master_port=int(master["port"]), frozen_ts=time.time())
        if not self._cas_round(value, index):
            return False
        self._forget_round(int(rnd["round"]) - 1)
        return True

    def _forget_round(self, round_no: int) -> None:
        """Old join and done records are no longer read; drop them so `live/` stays small."""
        if round_no < 1:
            return
        for key in (self.keys.round_members(round_no), self.keys.done(round_no)):
            self.stats.writes += 1
            try:
                self.client.delete(key, recursive=True)
            except etcd.EtcdKeyNotFound:
                pass
            except etcd.EtcdException:
                pass


def _sort_key(member: tuple[dict[str, Any], int]) -> tuple[int, int, int]:
    record, created = member
    prev = record.get("prev_rank")
    return (0 if prev is not None else 1, int(prev) if prev is not None else 0, created)


def _loads(value: str | None) -> dict[str, Any]:
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
