"""P9, the fleet bench: N simulated nodes against one real etcd, on each store backend (issue 27).

    python bench/fleet.py --backends v3,v2 --nodes 64,256,1000 --out /tmp/fleet.json

What is real: the etcd 3.5 server (`--enable-v2`, one member on 127.0.0.1, its own data dir per run), the
store backends (`petctl/io/store`: v3 over gRPC, v2 over python-etcd), and every request they send. What
is simulated: the nodes. They run in `--procs` shard processes (default 1), dealt out round-robin, each
shard's nodes as threads (on v3 a shard's stores share one event loop), and they run a model of the
agent's rendezvous written against the same `Store` interface, with the agent's own liveness rules
(`--peer-watch`). This process only starts etcd, drives the shards through a pipe each, and reads the
times they recorded (CLOCK_MONOTONIC, one clock for every process on the host). One process saturates
from about 256 nodes (its beats run late, live nodes are dropped): `--procs 4` spreads 1000 over the
cores, which they then share with etcd. The model is the agent's pattern:
- liveness: a key `live/nodes/<node>` per node. v2: a TTL'd key refreshed every `--beat` seconds (the
  agent's default, 0.2 s, each refresh a raft proposal). v3: the key lives under a lease of `--ttl`
  seconds kept alive every ttl/3 (a keep-alive is not a proposal).
- the reads (`--model agent`, the default): the agent's own. A node waiting for a round that ranks it,
  other than the closer, watches `live/round` only; on a round change it takes the record from the
  watch event (no read: `EtcdRendezvous._round_now`), which admits it when the round ranks it, else it
  reads `live/` whole; after a safety-net period it reads `live/` whole. The
  closer watches `live/` and reads it whole on each wake. A ranked node watches `live/` from the revision
  it was admitted at, first reads it whole `decisions.first_look_after(rank)` s later (rank / 100 s), then
  folds each wake's events into its view and reads it whole every safety-net period
  (`decisions.safety_period`: about `IDLE` and `VIEW_EVERY` in fleets of up to 100 and 200 nodes,
  longer beyond, spread per node from 0.55 to 1.65 times that; the agent's own). `--model
  every-node`, the bench's first model: every node watches `live/` throughout from its first
  listing and keeps its own view from the events, with no further whole reads.
- the round: when the closer's view holds every member and `live/round` does not rank them all, it writes
  a new round with compare-and-swap (ranks kept, newcomers appended). A node is ranked when a watch event
  or a read shows it a round that ranks it.

Measured, per backend and N:
- `up_to_ranked_s`: the last node registered → every node has seen itself ranked; of it,
  `up_to_round_written_s`: → the closer wrote the round (the rest is the round reaching every node);
- `loss_known_s`: a node's lease revoked (a clean leave, as an agent does on a notice or a kill) →
  every survivor's watch saw its key go;
- `silent_loss_known_s`: a node that just stops keeping its lease alive (a host gone without a word) →
  every survivor saw its key go: the TTL plus etcd's expiry granularity, or with `--peer-watch` the peer
  watch's limit plus a poll;
- `--peer-watch`: the agent's peer watch too, with its own rules (`observe`, `successor`, `silence_limit`
  from petctl/agent/liveness.py) and the same Store calls (`Store.liveness`, `Store.expire`): each node
  reads the next-ranked member every limit/10 s and ends its hold once silent for the limit (1 s); the
  keep-alives then come every `--beat` s on both backends, as the agent's do. `silent_loss_known_s` is
  then the peer watch's detection, and the requests at rest include its reads;
- `join_ranked_s`: a new node registers → every node saw a round that ranks it, the old ranks unchanged
  (`ranks_kept`);
- at rest (`--rest` s): etcd's committed proposals and the client's requests per node per second (a
  keep-alive, a refresh, a watch poll, a read of `live/round` and a whole read of `live/` each count as
  one request), the keys those reads returned per node per second (a whole read returns every node's
  key: what grows with N), and etcd's CPU and RSS;
- `lost_place`: watches that fell behind the store's history (v3 compaction, v2's 1,000-event window)
  and had to re-list;
- `spurious_losses`: nodes whose key went while nothing stopped them (a keep-alive or refresh too late
  for its TTL: what a short TTL costs on a busy host), and of them `spurious_after_ranked`, those lost
  after every node was ranked (at rest, and through the leave and the join): the mass registration
  before that is the simulator's busiest moment, every node booting in the same second;
- `reasserted`: keys a live node had to write again because its lease had run out;
- `beats_late`: liveness beats that ran more than one interval late (the simulator itself saturated:
  then the figures say more about this process than about etcd).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import runmeta  # noqa: E402
from petctl.core.store import Batch, Compacted, Event, Lease, LeaseExpired, Store, StoreError  # noqa: E402
from petctl.io.etcd import EtcdServer  # noqa: E402
from petctl.io.store import open_store  # noqa: E402

JOB = "/petctl/jobs/fleet"
LIVE = f"{JOB}/live"
NODES = f"{LIVE}/nodes"
ROUND = f"{LIVE}/round"


@dataclass
class Counters:
    """Requests this process sent, by kind (thread-safe)."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + n

    def total(self) -> int:
        """Requests: every kind but `keys`, which counts the keys the reads returned."""
        with self.lock:
            return sum(n for kind, n in self.counts.items() if kind != "keys")

    def keys(self) -> int:
        with self.lock:
            return self.counts.get("keys", 0)


@dataclass
class FleetRow:
    backend: str
    nodes: int
    up_to_ranked_s: float | None
    loss_known_s: float | None
    silent_loss_known_s: float | None
    join_ranked_s: float | None
    ranks_kept: bool
    rest_proposals_per_node_s: float
    rest_requests_per_node_s: float
    reform_proposals_per_node: float
    etcd_cpu_pct: float
    etcd_rss_mb: float
    lost_place: int
    spurious_losses: int
    reasserted: int
    beats_late: int
    errors: int
    note: str = ""
    peer_watch: bool = False  # the agent's peer watch ran too (--peer-watch)
    procs: int = 1  # the shard processes the nodes ran in (--procs)
    rest_keys_read_per_node_s: float = 0.0  # keys the whole reads of live/ returned (what grows with N)
    model: str = "agent"  # whose reads the nodes make (--model): the agent's, or every node watching live/
    spurious_after_ranked: int = 0  # of spurious_losses, those after every node was ranked
    up_to_round_written_s: float | None = None  # of up_to_ranked_s, the closer's part: the round written


class SimNode:
    """One simulated node: its liveness key, its watch on `live/`, its view, and its round writes."""

    def __init__(self, name: str, store: Store, fleet: Fleet) -> None:
        self.name = name
        self.store = store
        self.fleet = fleet
        self.lease: Lease | None = None
        self.last_beat = 0.0  # when the latest keep-alive that went through was sent
        self.members: set[str] = set()
        self.ranks: dict[str, int] = {}
        self.round_rev = 0
        self.seen: dict[str, float] = {}  # what this node saw, and when: "ranked", "gone:<n>", "ranked:<n>"
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.peer_seen = None  # the peer watch's Observation (petctl/agent/liveness.py)
        self.peer_known = None  # (peer, its last Store.liveness answer)

    # --- liveness ----------------------------------------------------------------------------------------
    def register(self) -> None:
        # v3: a real lease; v2: the backend's emulation, a TTL'd key refreshed on each keep-alive
        self.lease = self.store.grant(self.fleet.ttl)
        self.store.put(f"{NODES}/{self.name}", self.name, self.lease)
        self.fleet.counters.add("register", 2)

    def beat(self) -> None:
        lease = self.lease
        if lease is None:
            return
        sent = time.monotonic()
        try:
            lease.keepalive()
        except LeaseExpired:  # too late for its TTL: write the key again, as the agent reasserts its own
            if self.stop.is_set():  # muted while this beat was in flight: it is gone, never back
                return
            self.fleet.reasserted_inc()
            self.register()
        self.last_beat = sent
        self.fleet.counters.add("beat")

    # --- the peer watch (the agent's rules: petctl/agent/liveness.py) --------------------------------------
    def peer_poll(self) -> None:
        """One read of the member this node watches, judged by the agent's own `observe`; a silent one's
        hold ended with `Store.expire`, as the agent's PeerWatch does."""
        from petctl.agent.liveness import Reading, observe, successor

        peer = successor(self.ranks, self.name) if self.name in self.ranks else None
        if peer is None or self.stop.is_set():
            self.peer_seen, self.peer_known = None, None
            return
        known = self.peer_known if self.peer_known is not None and self.peer_known[0] == peer else None
        sent = time.monotonic()
        found = self.store.liveness(f"{NODES}/{peer}", known[1] if known else None)
        self.fleet.counters.add("peer", 1 if known is not None or self.store.backend == "v2" else 2)
        self.peer_known = (peer, found) if found is not None else None
        reading = Reading(node=peer, index=found.mod_revision if found else None, sent=sent,
                          received=time.monotonic(), own_refresh_sent=self.last_beat or None, settled=True,
                          quiet=found.quiet if found else None)
        self.peer_seen, silent = observe(self.peer_seen, reading, self.fleet.limit, self.fleet.beat_interval)
        if silent is not None and self.peer_seen is not None:
            if self.store.expire(f"{NODES}/{peer}", self.peer_seen.index):
                self.fleet.counters.add("expire")
            self.peer_seen, self.peer_known = None, None

    # --- the watch and the round -------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"sim-{self.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        """The node's reads. `--model every-node`: one whole read of `live/`, then a watch on it for good,
        the view kept from its events. `--model agent` (the default), the agent's own pattern, with its
        constants:
        - a node waiting for a round that ranks it, other than the closer, pauses its `live/` watch
          (petctl/agent/rendezvous.py): it wakes on a change of `live/round` (a key watch) and then reads
          that one key, which admits it when the round ranks it (`decisions.admitted_by`), else `live/`
          whole; or it wakes after `decisions.safety_period(IDLE, N, node)` s and reads `live/` whole;
        - the closer (`_closer`) watches `live/`, reads it whole on each wake or after `IDLE` s, and
          writes the round;
        - a ranked node (the agent's round runner) watches `live/` from the revision it was admitted at,
          first reads it whole `decisions.first_look_after(rank)` s after admission (or on an earlier
          wake), then folds each wake's events into its view (`EtcdRendezvous.view_since`) and reads it
          whole every `safety_period(roundrunner.VIEW_EVERY, N, node)` s; the closer reads it whole on each
          wake, as the agent's closer does.
        Each whole read is one request whose answer grows with N: what the agent's views cost etcd."""
        from petctl.agent.decisions import IDLE, first_look_after, safety_period
        from petctl.agent.roundrunner import VIEW_EVERY

        agent = self.fleet.model == "agent"
        woke_on: Event | None = None  # the round event that woke a paused joiner: it carries the record
        folding = False  # a ranked node past its first whole read folds events into its view
        while not self.stop.is_set():
            try:
                was_ranked = self.name in self.ranks
                revision = 0
                if woke_on is not None:  # as the agent's _round_now: the record from the event, no read
                    self._round(woke_on.value, woke_on.revision)
                    revision = woke_on.revision
                if woke_on is None or self.name not in self.ranks:
                    revision = self._look()
                    folding = was_ranked and self.name in self.ranks
                woke_on = None
                ranked, closer = self.name in self.ranks, self._closer() == self.name
                paused = agent and not (ranked or closer)
                if not agent:
                    period = math.inf
                elif ranked and not was_ranked:  # admitted: the round runner's first look waits its turn
                    period = first_look_after(self.ranks[self.name])
                elif ranked:
                    period = safety_period(VIEW_EVERY, len(self.members), self.name)
                else:
                    period = IDLE if closer else safety_period(IDLE, len(self.members), self.name)
                if paused:
                    watch = self.store.watch_key(ROUND, revision + 1)
                else:
                    watch = self.store.watch(LIVE, revision + 1)
                due = time.monotonic() + period
                try:
                    while not self.stop.is_set() and (left := due - time.monotonic()) > 0:
                        batch = watch.wait(min(left, 0.5))
                        if self.store.backend == "v2":  # a long poll per wait; v3 streams on one call
                            self.fleet.counters.add("watch")
                        if not paused:
                            self._apply(batch, decide=not agent)
                        else:  # a paused joiner: the round record, from the newest event that carries it
                            rounds = [e for e in batch.events if e.key == ROUND and e.value is not None]
                            woke_on = rounds[-1] if rounds else None
                        if agent and batch.events and (paused or closer or not folding):
                            break  # a wake: the agent reads a fresh view (a paused one, the event's record)
                finally:
                    watch.close()
            except Compacted:
                self.fleet.lost_place_inc()
            except StoreError as e:
                self.fleet.error_inc(e)
                self.stop.wait(0.1)

    def _look(self) -> int:
        """One read of `live/` whole (the agent's view): members, the round, and the closer's write."""
        listing = self.store.list(LIVE)
        self.fleet.counters.add("list")
        self.fleet.counters.add("keys", len(listing.entries))
        now = time.monotonic()
        members = {k.rsplit("/", 1)[1] for k in listing.values() if k.startswith(NODES + "/")}
        for node in self.members - members:
            self.seen.setdefault(f"gone:{node}", now)
        self.members = members
        for entry in listing.entries:
            if entry.key == ROUND:
                self._round(entry.value, entry.mod_revision)
        self._maybe_round()
        return listing.revision

    def _apply(self, batch: Batch, decide: bool = True) -> None:
        now = time.monotonic()
        for ev in batch.events:
            if ev.key.startswith(NODES + "/"):
                node = ev.key.rsplit("/", 1)[1]
                if ev.kind == "put":
                    self.members.add(node)
                else:
                    self.members.discard(node)
                    self.seen.setdefault(f"gone:{node}", now)
            elif ev.key == ROUND and ev.value is not None:
                self._round(ev.value, ev.revision)
        if batch.events and decide:
            self._maybe_round()

    def _round(self, value: str, rev: int) -> None:
        self.ranks = json.loads(value)
        self.round_rev = rev
        now = time.monotonic()
        if self.name in self.ranks:
            self.seen.setdefault("ranked", now)
        for node in self.ranks:
            self.seen.setdefault(f"ranked:{node}", now)

    def _closer(self) -> str | None:
        """The agent's closing order (decisions.closing_order): the member of lowest rank in the round,
        newcomers after every ranked member; before any round, the first member by name."""
        ranked = [n for n in self.members if n in self.ranks]
        if ranked:
            return min(ranked, key=self.ranks.__getitem__)
        return min(self.members, default=None)

    def _maybe_round(self) -> None:
        """Write a round ranking every member this node sees, where the current one misses some. The
        first round waits for all `expected` nodes (the agent's first round waits for the job's size);
        only the closer (`_closer`) writes, so one write per round."""
        if not self.ranks and len(self.members) < self.fleet.expected:
            return
        missing = sorted(self.members - set(self.ranks))
        if not missing or self._closer() != self.name:
            return
        ranks = {n: r for n, r in self.ranks.items() if n in self.members}
        nxt = max(ranks.values(), default=-1) + 1
        for i, node in enumerate(missing):
            ranks[node] = nxt + i
        value = json.dumps(ranks, sort_keys=True)
        if self.round_rev:
            self.store.replace(ROUND, value, self.round_rev)
        else:
            self.store.create(ROUND, value)
        self.fleet.counters.add("round")
        self.fleet.round_written = time.monotonic()


class Fleet:
    """N simulated nodes, their shared beat scheduler, and what they measured."""

    def __init__(self, endpoint: str, backend: str, ttl: int, beat: float, peer_watch: bool = False,
                 model: str = "agent") -> None:
        from petctl.agent.liveness import poll_period, silence_limit
        from petctl.core.spec import Timeouts

        self.endpoint = endpoint
        self.backend = backend
        self.ttl = ttl
        # the agent keeps alive every `beat` on both backends; the model without a peer watch needs only
        # ttl/3 on v3 (nothing reads the lease but etcd's expiry)
        self.beat_interval = beat if backend == "v2" or peer_watch else ttl / 3
        self.peer_watch = peer_watch
        self.model = model
        self.limit = silence_limit(Timeouts(heartbeat_interval=beat, heartbeat_ttl=float(ttl)))
        self.poll = poll_period(self.limit)
        self._watcher: threading.Thread | None = None
        self.counters = Counters()
        self.expected = 0
        self.round_written = 0.0  # when one of this shard's nodes last wrote a round (monotonic)
        self.nodes: list[SimNode] = []
        self._lock = threading.Lock()
        self.lost_place = 0
        self.reasserted = 0  # keys written again after their lease ran out under a live node
        self.errors = 0
        self.error_kinds: dict[str, int] = {}
        self.beats_late = 0
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None
        self._loop = None

    def reasserted_inc(self) -> None:
        with self._lock:
            self.reasserted += 1

    def lost_place_inc(self) -> None:
        with self._lock:
            self.lost_place += 1

    def error_inc(self, error: BaseException | None = None) -> None:
        with self._lock:
            self.errors += 1
            if error is not None:
                kind = f"{type(error).__name__}: {str(error)[:120]}"
                self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def new_store(self) -> Store:
        if self.backend == "v3" and self._loop is None:
            from petctl.io.store.v3 import LoopThread

            self._loop = LoopThread("fleet-loop")  # every simulated node's store on one event loop
        return open_store(self.endpoint, backend=self.backend, loop=self._loop)  # type: ignore[arg-type]

    def add(self, name: str) -> SimNode:
        node = SimNode(name, self.new_store(), self)
        self.nodes.append(node)
        return node

    def start_beats(self) -> None:
        self._beater = threading.Thread(target=self._beat_loop, name="sim-beats", daemon=True)
        self._beater.start()
        if self.peer_watch:
            self._watcher = threading.Thread(target=self._peer_loop, name="sim-peers", daemon=True)
            self._watcher.start()

    def _peer_loop(self) -> None:
        pool = ThreadPoolExecutor(max_workers=16)

        def poll(node: SimNode) -> None:
            try:
                node.peer_poll()
            except StoreError as e:
                node.peer_seen, node.peer_known = None, None
                self.error_inc(e)
        try:
            due = time.monotonic()
            while not self._stop.is_set():
                due += self.poll
                list(pool.map(poll, [n for n in list(self.nodes) if n.lease is not None]))
                lag = time.monotonic() - due
                if lag > self.poll:
                    due = time.monotonic()
                else:
                    self._stop.wait(max(0.0, -lag))
        finally:
            pool.shutdown(wait=True)

    def _beat_loop(self) -> None:
        # a thread per node (up to 256): each node's keep-alive goes when due, as on its own host, not
        # queued behind other nodes' on a loop busy with their reads
        pool = ThreadPoolExecutor(max_workers=256)
        try:
            due = time.monotonic()
            while not self._stop.is_set():
                due += self.beat_interval
                live = [n for n in list(self.nodes) if n.lease is not None and not n.stop.is_set()]
                list(pool.map(_beat_quietly(self), live))
                lag = time.monotonic() - due
                if lag > self.beat_interval:
                    with self._lock:
                        self.beats_late += len(live)
                    due = time.monotonic()
                else:
                    self._stop.wait(max(0.0, -lag))
        finally:
            pool.shutdown(wait=True)

    def close(self) -> None:
        self._stop.set()
        for thread in (self._beater, self._watcher):
            if thread is not None:
                thread.join(timeout=10)
        for n in self.nodes:
            n.stop.set()
        for n in self.nodes:
            if n.thread is not None:
                n.thread.join(timeout=5)
            n.store.close()
        if self._loop is not None:
            self._loop.close()


def _beat_quietly(fleet: Fleet) -> Callable[[SimNode], None]:
    def beat(node: SimNode) -> None:
        try:
            node.beat()
        except StoreError as e:
            fleet.error_inc(e)
    return beat


def wait_for(cond: Callable[[], bool], timeout: float, poll: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(poll)
    return cond()


def proposals(endpoint: str) -> float:
    """etcd's committed raft proposals, from its /metrics."""
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=5).read().decode()  # noqa: S310
    m = re.search(r"^etcd_server_proposals_committed_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


# etcd's raft timing for a 1 s lease: etcd raises any TTL to 1.5 election timeouts (2 s at its defaults of
# 100 ms heartbeats and a 1 s election timeout); a 500 ms election timeout allows 1 s (`--fast-raft`).
FAST_RAFT = ("--heartbeat-interval", "50", "--election-timeout", "500")


class Shard:
    """One shard process's end of the pipe: the commands `run_one` sends, carried out on its own `Fleet`.
    Every answer is plain data (names, times, counts), so it crosses the pipe."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.by_name: dict[str, SimNode] = {}

    def add(self, names: list[str], expected: int) -> None:
        self.fleet.expected = expected
        for name in names:
            node = self.fleet.add(name)
            self.by_name[name] = node
            node.start()

    def start_beats(self) -> None:
        self.fleet.start_beats()

    def register(self, names: list[str]) -> float:
        """Register `names` (in parallel); when the registrations started."""
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda n: self.by_name[n].register(), names))
        return started

    def round_written(self) -> float:
        """When one of this shard's nodes last wrote a round (0.0: never)."""
        return self.fleet.round_written

    def seen(self, key: str, skip: list[str]) -> float | None:
        """The latest time any of this shard's nodes (but `skip`) saw `key`; None while one has not."""
        times = [s.seen.get(key) for n, s in list(self.by_name.items()) if n not in skip]
        return None if any(x is None for x in times) else max(times, default=0.0)  # type: ignore[type-var]

    def caught_up(self, members: int) -> bool:
        """Whether each of this shard's nodes sees at least `members` members."""
        return all(len(s.members) >= members for s in self.by_name.values())

    def ranks(self, name: str) -> dict[str, int]:
        return dict(self.by_name[name].ranks)

    def leave(self, name: str) -> float:
        """`name` leaves cleanly (its lease revoked); when it started to."""
        node = self.by_name[name]
        node.stop.set()
        t = time.monotonic()
        if node.lease is not None:
            node.lease.revoke()
        node.lease = None
        return t

    def mute(self, name: str) -> float:
        """`name` goes silent (no revoke, no more keep-alives); when its last keep-alive was sent."""
        node = self.by_name[name]
        sent = node.last_beat
        node.stop.set()
        node.lease = None  # the beat loop skips it from now on
        return sent

    def gone(self, clear: bool) -> list[str]:
        """Every node some node here saw go; with `clear`, forgotten (a clean slate)."""
        # the nodes' watch threads add to `seen` meanwhile: read copies, delete one key at a time
        out = {k.split(":", 1)[1] for s in self.by_name.values() for k in list(s.seen)
               if k.startswith("gone:")}
        if clear:
            for s in self.by_name.values():
                for k in [k for k in list(s.seen) if k.startswith("gone:")]:
                    s.seen.pop(k, None)
        return sorted(out)

    def requests(self) -> int:
        return self.fleet.counters.total()

    def keys(self) -> int:
        return self.fleet.counters.keys()

    def stats(self) -> dict[str, object]:
        f = self.fleet
        return {"lost_place": f.lost_place, "reasserted": f.reasserted, "beats_late": f.beats_late,
                "errors": f.errors, "error_kinds": dict(f.error_kinds)}


def _shard_main(conn, endpoint: str, backend: str, ttl: int, beat: float, peer_watch: bool,
                model: str) -> None:
    """A shard process: a `Fleet` of its own, driven by (method, args) messages until "close"."""
    fleet = Fleet(endpoint, backend, ttl, beat, peer_watch, model)
    shard = Shard(fleet)
    try:
        while True:
            method, args = conn.recv()
            if method == "close":
                break
            try:
                conn.send(("ok", getattr(shard, method)(*args)))
            except Exception as e:  # noqa: BLE001 - the driver raises it, with the shard's message
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        fleet.close()
        conn.send(("stats", shard.stats()))
        conn.close()


class Shards:
    """The driver's side: every shard process, and which one holds each node."""

    def __init__(self, procs: int, endpoint: str, backend: str, ttl: int, beat: float,
                 peer_watch: bool, model: str = "agent") -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork: a forked gRPC or a forked thread is unsafe
        self.conns = []
        self.procs = []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_shard_main, args=(child, endpoint, backend, ttl, beat, peer_watch, model),
                            daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.where: dict[str, int] = {}

    def ask(self, orders: dict[int, tuple]) -> dict[int, object]:
        """Send each shard in `orders` its (method, args), then read every answer (so no pipe keeps a stale
        one), and return them by shard. Raises RuntimeError with the first shard's error."""
        for i, order in orders.items():
            self.conns[i].send(order)
        answers = {i: self.conns[i].recv() for i in orders}
        for i, (status, value) in answers.items():
            if status != "ok":
                raise RuntimeError(f"shard {i}: {orders[i][0]}: {value}")
        return {i: value for i, (_, value) in answers.items()}

    def each(self, method: str, *args) -> list:
        """`method` on every shard at once."""
        return list(self.ask({i: (method, args) for i in range(len(self.conns))}).values())

    def add(self, names: list[str], expected: int) -> None:
        start = len(self.where)
        dealt: list[list[str]] = [[] for _ in self.conns]
        for j, name in enumerate(names):
            i = (start + j) % len(self.conns)
            self.where[name] = i
            dealt[i].append(name)
        self.ask({i: ("add", (mine, expected)) for i, mine in enumerate(dealt)})

    def register(self, names: list[str]) -> float:
        dealt: dict[int, list[str]] = {}
        for name in names:
            dealt.setdefault(self.where[name], []).append(name)
        return min(self.ask({i: ("register", (mine,)) for i, mine in dealt.items()}).values())  # type: ignore[type-var]

    def seen_by_all(self, key: str, skip: tuple[str, ...] = ()) -> float | None:
        times = self.each("seen", key, list(skip))
        return None if any(x is None for x in times) else max(times)

    def wait_seen(self, key: str, timeout: float, skip: tuple[str, ...] = ()) -> float | None:
        end = time.monotonic() + timeout
        while True:
            got = self.seen_by_all(key, skip)
            if got is not None or time.monotonic() > end:
                return got
            time.sleep(0.05)

    def of(self, name: str, method: str, *args):
        i = self.where[name]
        return self.ask({i: (method, (name, *args))})[i]

    def requests(self) -> int:
        return sum(self.each("requests"))

    def keys(self) -> int:
        return sum(self.each("keys"))

    def gone(self, clear: bool = False) -> set[str]:
        return {n for names in self.each("gone", clear) for n in names}

    def close(self) -> dict:
        for conn in self.conns:
            try:
                conn.send(("close", ()))
            except OSError:
                pass
        totals: dict = {"lost_place": 0, "reasserted": 0, "beats_late": 0, "errors": 0, "error_kinds": {}}
        for conn, p in zip(self.conns, self.procs, strict=True):
            try:
                status, stats = "", None
                while status != "stats" and conn.poll(30):  # past any answer left unread by a failure
                    status, stats = conn.recv()
                if status == "stats" and isinstance(stats, dict):
                    for k in ("lost_place", "reasserted", "beats_late", "errors"):
                        totals[k] += stats[k]
                    for kind, n in stats["error_kinds"].items():
                        totals["error_kinds"][kind] = totals["error_kinds"].get(kind, 0) + n
            except (EOFError, OSError):
                pass
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        return totals


def run_one(backend: str, n: int, ttl: int, beat: float, rest: float, scratch: Path,
            fast_raft: bool = False, peer_watch: bool = False, procs: int = 1,
            model: str = "agent") -> FleetRow:
    import psutil

    server = EtcdServer.start(scratch / f"etcd-{backend}-{n}", extra_args=FAST_RAFT if fast_raft else ())
    proc = psutil.Process(server.pid)
    shards = Shards(procs, server.endpoint, backend, ttl, beat, peer_watch, model)
    totals: dict = {}
    try:
        names = [f"n{i:04d}" for i in range(n)]
        shards.add(names, n)
        shards.each("start_beats")
        shards.register(names[:-1])
        t_reg = time.monotonic()
        # every watch caught up with the others' registrations: the clock starts at the last node's
        caught_up = wait_for(lambda: all(shards.each("caught_up", n - 1)), 60 + n / 5, poll=0.1)
        _progress(backend, n, f"{n - 1} registered, every watch caught up: {caught_up} "
                              f"({time.monotonic() - t_reg:.0f} s)")
        last_up = shards.register(names[-1:])
        up = shards.wait_seen("ranked", 60 + n / 10)
        up_to_ranked = up - last_up if up is not None else None
        written = max(shards.each("round_written"))  # the closer's part of it: the round written
        up_to_written = written - last_up if written > last_up else None
        before = shards.of(names[0], "ranks")
        lost_forming = shards.gone()  # nodes taken for lost while the fleet registered and was ranked
        _progress(backend, n, f"all up -> all ranked: {up_to_ranked} (round written after {up_to_written})")

        # at rest
        p0, c0, k0, cpu0 = proposals(server.endpoint), shards.requests(), shards.keys(), proc.cpu_times()
        t0 = time.monotonic()
        time.sleep(rest)
        p1, c1, k1, cpu1 = proposals(server.endpoint), shards.requests(), shards.keys(), proc.cpu_times()
        t1 = time.monotonic()
        span = t1 - t0
        rest_props = (p1 - p0) / n / span
        rest_reqs = (c1 - c0) / n / span
        rest_keys = (k1 - k0) / n / span
        cpu_pct = 100 * ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / span
        rss = proc.memory_info().rss / 2**20

        # nodes taken for lost so far while alive (a keep-alive too late for the TTL), then a clean slate
        spurious_up = shards.gone(clear=True)

        # a node lost (its lease revoked: a clean loss) -> every survivor knows
        p_re0, t_re0 = proposals(server.endpoint), time.monotonic()
        victim = names[-1]
        t_loss = shards.of(victim, "leave")
        known = shards.wait_seen(f"gone:{victim}", 30, skip=(victim,))
        loss_known = known - t_loss if known is not None else None

        # a node joins -> every node sees a round ranking it, old ranks kept
        joiner = f"j{n:04d}"
        shards.add([joiner], n)
        t_join = time.monotonic()
        shards.register([joiner])
        ranked = shards.wait_seen(f"ranked:{joiner}", 30, skip=(victim,))
        join_ranked = ranked - t_join if ranked is not None else None
        after = shards.of(names[0], "ranks")
        kept = all(after.get(k) == v for k, v in before.items() if k != victim)
        # the leave's and the join's own proposals: the beats' steady rate over the same span taken out
        beats = (p1 - p0) / span * (time.monotonic() - t_re0)
        reform_props = (proposals(server.endpoint) - p_re0 - beats) / n

        _progress(backend, n, f"leave known {loss_known}, join ranked {join_ranked}")
        # a node goes silent: no revoke, no more keep-alives -> every other node sees its key expire
        mute = names[-2]
        beat_sent = shards.of(mute, "mute")
        known = shards.wait_seen(f"gone:{mute}", 3 * ttl + 10, skip=(victim, mute))
        silent_known = known - beat_sent if known is not None else None
        lost = spurious_up | (shards.gone() - {victim, mute})
        spurious, spurious_after = len(lost), len(lost - lost_forming)
    finally:
        totals = shards.close()
        server.stop(remove_data=True)
    note = "simulator saturated: beats ran late" if totals.get("beats_late") else ""
    if not caught_up:
        note = "; ".join([note, "the watches had not caught up with the registrations"]).strip("; ")
    if totals.get("error_kinds"):
        top = sorted(totals["error_kinds"].items(), key=lambda kv: -kv[1])[:3]
        note = "; ".join([note, *(f"{n} x {k}" for k, n in top)]).strip("; ")
    return FleetRow(backend=backend, nodes=n, up_to_ranked_s=_r(up_to_ranked), loss_known_s=_r(loss_known),
                    silent_loss_known_s=_r(silent_known),
                    join_ranked_s=_r(join_ranked), ranks_kept=kept,
                    rest_proposals_per_node_s=round(rest_props, 4),
                    rest_requests_per_node_s=round(rest_reqs, 3),
                    rest_keys_read_per_node_s=round(rest_keys, 1),
                    reform_proposals_per_node=round(reform_props, 3), etcd_cpu_pct=round(cpu_pct, 1),
                    etcd_rss_mb=round(rss, 1), lost_place=totals["lost_place"], spurious_losses=spurious,
                    reasserted=totals["reasserted"], beats_late=totals["beats_late"],
                    errors=totals["errors"], note=note, peer_watch=peer_watch, procs=procs,
                    model=model, spurious_after_ranked=spurious_after,
                    up_to_round_written_s=_r(up_to_written))


def _progress(backend: str, n: int, text: str) -> None:
    print(f"  {backend} N={n}: {text}", file=sys.stderr, flush=True)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def table(rows: list[FleetRow]) -> str:
    head = ("| backend | N | all up → all ranked (→ round written) | leave → every survivor knows "
            "| silent loss → every survivor knows "
            "| join → ranked (old ranks kept) | proposals / node / 10 s at rest "
            "| requests / node / s at rest | keys read / node / s at rest | etcd CPU at rest | etcd RSS "
            "| watches that lost their place | nodes lost while alive (after all ranked) | beats late |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f} s"
        name = f"{r.backend} + peer watch" if r.peer_watch else r.backend
        name += f" ({r.procs} procs)" if r.procs > 1 else ""
        name += ", every node watching" if r.model == "every-node" else ""
        lines.append(f"| {name} | {r.nodes} | {s(r.up_to_ranked_s)} ({s(r.up_to_round_written_s)}) | "
                     f"{s(r.loss_known_s)} | "
                     f"{s(r.silent_loss_known_s)} | "
                     f"{s(r.join_ranked_s)} ({'yes' if r.ranks_kept else 'NO'}) | "
                     f"{10 * r.rest_proposals_per_node_s:.2f} | {r.rest_requests_per_node_s:.2f} | "
                     f"{r.rest_keys_read_per_node_s:.0f} | "
                     f"{r.etcd_cpu_pct:.0f} % | {r.etcd_rss_mb:.0f} MB | {r.lost_place} | "
                     f"{r.spurious_losses} ({r.spurious_after_ranked}) | {r.beats_late} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    meta = runmeta.start(None if argv is None else ["bench/fleet.py", *argv])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="v3,v2")
    ap.add_argument("--nodes", default="64,256,1000")
    ap.add_argument("--ttl", type=int, default=3, help="liveness TTL, seconds (the agent's heartbeat_ttl)")
    ap.add_argument("--beat", type=float, default=0.2,
                    help="v2 refresh interval (the agent's heartbeat_interval)")
    ap.add_argument("--rest", type=float, default=10.0, help="seconds measured at rest")
    ap.add_argument("--fast-raft", action="store_true",
                    help="etcd with a 500 ms election timeout, so a lease may be 1 s (default: etcd's)")
    ap.add_argument("--peer-watch", action="store_true",
                    help="run the agent's peer watch too (each node reads its successor's liveness)")
    ap.add_argument("--procs", type=int, default=1,
                    help="shard processes the simulated nodes are dealt over (round-robin)")
    ap.add_argument("--model", choices=("agent", "every-node"), default="agent",
                    help="the nodes' reads: the agent's own (a paused watch while waiting, whole views "
                         "of live/), or every node watching live/ throughout (the model of 2026-11-27)")
    ap.add_argument("--out", default="bench/results/fleet.json")
    args = ap.parse_args(argv)
    rows: list[FleetRow] = []
    with tempfile.TemporaryDirectory(prefix="petctl-fleet-") as scratch:
        for n in (int(x) for x in args.nodes.split(",")):
            for backend in args.backends.split(","):
                started = time.monotonic()
                row = run_one(backend, n, args.ttl, args.beat, args.rest, Path(scratch), args.fast_raft,
                              args.peer_watch, args.procs, args.model)
                rows.append(row)
                took = time.monotonic() - started
                print(f"{backend} N={n}: {json.dumps(asdict(row))} ({took:.0f} s)", flush=True)
    md = table(rows)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**runmeta.finish(meta), "rows": [asdict(r) for r in rows],
                               "median_up_to_ranked_s": statistics.median(
                                   [r.up_to_ranked_s for r in rows if r.up_to_ranked_s is not None] or [0])},
                              indent=2) + "\n")
    out.with_suffix(".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
