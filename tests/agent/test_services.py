"""The agent's services: outages reported once each way and counted, a watcher that stops promptly, and a
crash that is never silent (one `agent.crashed` event, exit 70, services stopped on the way out)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from petctl.agent.decisions import RendezvousState, Settings, StoreView
from petctl.agent.health import OutageReporter, StoreHealth, describe
from petctl.agent.leases import LeaseClasses
from petctl.agent.liveness import Heartbeat
from petctl.agent.rendezvous import FIRST_JOINERS, EtcdRendezvous, LiveReader, LiveWatcher, RequestStats
from petctl.agent.reporting import EtcdEventSink
from petctl.core.keys import JobKeys
from petctl.core.records import DoneRecord, JoinRecord, NodeRecord, Phase, Round
from petctl.core.store import Event, Store
from petctl.io.procs import free_port
from tests.support.agent_harness import AgentCluster, make_spec, wait_for
from tests.support.emitter import Recorder
from tests.support.store import FakeStore, store_for


# --- the outage reporter -------------------------------------------------------------------------------
def test_an_outage_is_reported_once_when_it_starts_and_once_when_it_ends():
    rec, clock = Recorder(), iter([10.0, 12.5, 20.0, 21.0])
    outage = OutageReporter("watch", rec, clock=lambda: next(clock))
    outage.succeeded()
    for _ in range(5):
        outage.failed(ConnectionError("refused\n  twice"))
    outage.succeeded()
    outage.succeeded()
    outage.failed("again")
    outage.succeeded()
    assert rec.names() == ["watch.failing", "watch.recovered", "watch.failing", "watch.recovered"]
    assert rec.events[0][1] == {"service": "watch", "error": "ConnectionError: refused twice"}
    assert rec.events[1][1] == {"service": "watch", "failures": 5, "seconds": 2.5}
    assert outage.failures == 6 and not outage.down


def test_describe_is_one_short_line():
    text = describe(RuntimeError("<html>\n" + "x" * 1000))
    assert "\n" not in text and len(text) == 300 and text.startswith("RuntimeError: <html> x")


def test_heartbeat_refresh_failures_are_counted_and_reported_once():
    rec = Recorder()
    client = FakeStore()
    beat = Heartbeat(client, JobKeys("j"), NodeRecord(node_id="n1", host_addr="h", pid=1), interval=0.02,
                     ttl=3, outage=OutageReporter("heartbeat", rec))
    beat.start()
    client.failures = 4
    wait_for(lambda: client.failures == 0 and "heartbeat.recovered" in rec.names(), 5, what="recovery")
    beat.stop(delete=True)
    beat.stop(delete=True)  # idempotent: one delete
    assert rec.names() == ["heartbeat.failing", "heartbeat.recovered"]
    assert beat.outage.failures == 4 and client.calls.count("revoke") == 1 and beat.reasserted == 0


def test_event_sink_counts_what_it_could_not_write():
    rec = Recorder()
    sink = EtcdEventSink(LeaseClasses(FakeStore(3)), JobKeys("j"), "n1", OutageReporter("events", rec))
    sink.start()
    for i in range(5):
        sink({"event": "e", "i": i})
    sink.stop()
    assert sink.dropped == 3 and rec.names() == ["events.failing", "events.recovered"]


# --- the watcher --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_watcher_wakes_on_live_events_and_stops_at_once_mid_poll(etcd_server, backend):
    keys = JobKeys(f"watched-{backend}")
    client = store_for(etcd_server.endpoint, backend=backend)
    client.put(keys.node("n0"), "{}")
    stats, rec = RequestStats(), Recorder()
    watcher = LiveWatcher(client, keys.live, stats, OutageReporter("watch", rec), poll_timeout=30)
    watcher.start()
    assert watcher.wait(5)  # the first read wakes the agent for a fresh snapshot
    time.sleep(0.3)
    watcher.changed.clear()
    client.put(keys.node("n1"), "{}")
    assert watcher.wait(5), "a heartbeat under live/ wakes the watcher"
    watcher.pause()
    time.sleep(1.5)  # the membership watch is closed within its 1 s pause check
    watcher.changed.clear()
    client.put(keys.node("n2"), "{}")
    assert not watcher.wait(1.0), "paused: a membership event wakes nobody"
    client.put(keys.round, "{}")
    assert watcher.wait(5), "paused or not, a round change wakes the watcher (its key watch)"
    watcher.resume()
    assert watcher.wait(5), "resuming wakes the agent for a fresh view"
    time.sleep(0.3)  # both threads are now blocked in their 30 s waits
    t0 = time.monotonic()
    watcher.stop()
    assert time.monotonic() - t0 < 1.0
    assert not any(t.is_alive() for t in watcher._threads)
    assert stats.watches >= 2 and rec.events == []
    client.close()


@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_a_watcher_started_after_the_registration_reads_nothing_and_misses_nothing(etcd_server, backend):
    """`start(after=R)` (R: the node's heartbeat registration, before anything it reads): both watches
    open from R + 1 without a read of the store's revision and without a wake for a fresh view, and a
    change made after R, before the watches opened, still reaches the agent as an event. Without `after`
    each watch reads the revision and the agent is woken (issue 47)."""
    keys = JobKeys(f"started-after-{backend}")
    client = store_for(etcd_server.endpoint, backend=backend)
    registered = client.put(keys.node("me"), "{}")
    client.put(keys.node("other"), "{}")  # after our registration, before the watches open
    stats, rec = RequestStats(), Recorder()
    watcher = LiveWatcher(client, keys.live, stats, OutageReporter("watch", rec), poll_timeout=30)
    watcher.start(after=registered)
    try:
        assert watcher.wait(5), "the change after the registration wakes the agent, as an event"
        wait_for(lambda: len(watcher._open) == 2, 5, what="both watches open")
        events, stale = watcher.take()
        assert [e.key for e in events] == [keys.node("other")] and not stale, (events, stale)
        assert stats.reads == 0, stats  # no revision read: the watches opened from R + 1
        client.put(keys.round, "{}")
        assert watcher.wait(5)  # the membership watch (it covers live/round too) may wake it first
        wait_for(lambda: watcher.round_seen() is not None, 5, what="the round watch's event")
    finally:
        watcher.stop()
    fresh = LiveWatcher(client, keys.live, RequestStats(), OutageReporter("watch", rec), poll_timeout=30)
    fresh.start()
    try:
        assert fresh.wait(5)
        wait_for(lambda: len(fresh._open) == 2, 5, what="both watches open")
        assert fresh.stats.reads == 2 and fresh.take() == ([], True)
    finally:
        fresh.stop()
    # As an agent starts it: the membership watch paused until its rendezvous resumes it (the closer,
    # after the view it decided on), the round watch on.
    at = client.put(keys.node("me"), "{}")
    joiner = LiveWatcher(client, keys.live, RequestStats(), OutageReporter("watch", rec), poll_timeout=30)
    joiner.start(after=at, membership=False)
    try:
        wait_for(lambda: len(joiner._open) == 1, 5, what="the round watch open")
        client.put(keys.node("arrival"), "{}")
        assert not joiner.wait(1.0), "an arrival wakes no joiner"
        seen = client.put(keys.round, '{"round": 2}')
        assert joiner.wait(5) and joiner.round_seen().revision == seen, "a round change wakes it"
        joiner.take()
        joiner.resume(after=seen)  # the closer: from the view it decided on, no fresh read, no wake
        wait_for(lambda: len(joiner._open) == 2, 5, what="the membership watch open")
        assert not joiner.wait(0.5) and joiner.stats.reads == 0
        client.put(keys.node("late"), "{}")
        assert joiner.wait(5)
        assert [e.key for e in joiner.take()[0]] == [keys.node("late")]
    finally:
        joiner.stop()
        client.close()
    assert rec.events == []


@contextmanager
def started_watcher(etcd_server, backend: str, job: str) -> Iterator[tuple[JobKeys, Store, RequestStats,
                                                                         LiveWatcher]]:
    """A LiveWatcher on `job`'s `live/`, started, past its first wake and with both its watches open;
    stopped after, having reported no outage."""
    keys = JobKeys(f"{job}-{backend}")
    client = store_for(etcd_server.endpoint, backend=backend)
    stats, rec = RequestStats(), Recorder()
    watcher = LiveWatcher(client, keys.live, stats, OutageReporter("watch", rec), poll_timeout=30)
    watcher.start()
    try:
        assert watcher.wait(5)
        # both watches open: a change made before one opens is in its fresh read, not in its events
        wait_for(lambda: len(watcher._open) == 2, 5, what="the round and membership watches open")
        yield keys, client, stats, watcher
    finally:
        watcher.stop()
        client.close()
    assert rec.events == []


@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_a_watcher_resumed_after_a_revision_wakes_only_for_what_changed_since(etcd_server, backend):
    """`resume(after=R)` (an admitted node: R is the freeze it knows `live/` from) replays what changed
    after R as events and wakes nobody for the rest: no fresh read, no wake of its own."""
    with started_watcher(etcd_server, backend, "resumed") as (keys, client, stats, watcher):
        pause(watcher, client.put, keys.node("n0"))
        known = client.put(keys.node("n1"), "{}")
        watcher.changed.clear()
        reads = stats.reads
        watcher.resume(after=known)
        assert not watcher.wait(1.5), "nothing changed after the known revision: no wake"
        assert stats.reads == reads, "resumed from a known revision: no fresh read"
        client.put(keys.node("n2"), "{}")
        assert watcher.wait(5), "a change after it wakes the agent"

        pause(watcher, client.put, keys.node("n2b"))
        known = client.put(keys.node("n3"), "{}")
        client.put(keys.node("n4"), "{}")  # changed while paused, after the known revision
        watcher.changed.clear()
        watcher.resume(after=known)
        assert watcher.wait(5), "what changed while paused, after the known revision, is replayed"


@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_the_watchers_request_count_is_what_etcd_serves(etcd_server, backend):
    """`RequestStats.watches` counts what the watches sent (`Watch.requests`): on v2 each wait is a long
    poll, so 20 changes under `live/` cost at least 20; on v3 the two watches (round and membership)
    each open one stream, so 20 changes cost nothing more (etcd counted 3 watch requests per node at
    128 nodes while the old count, one per wait, said 365-590)."""
    with started_watcher(etcd_server, backend, "counted") as (keys, client, stats, watcher):
        seen: set[str] = set()

        def taken(key: str) -> bool:  # the change reached the watcher's events (its count comes first)
            seen.update(e.key for e in watcher.take()[0])
            return key in seen

        for i in range(20):  # each change taken before the next: one poll each on v2
            client.put(keys.node(f"n{i}"), "{}")
            wait_for(lambda i=i: taken(keys.node(f"n{i}")), 5, what=f"change {i}")
        if backend == "v3":
            assert stats.watches == 2
        else:
            assert stats.watches >= 20


@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_a_view_folded_from_watch_events_is_the_view_a_whole_read_gives(etcd_server, backend):
    """What a running node does on a wake (`EtcdRendezvous.view_since`): fold the watch's events into its
    view instead of reading `live/` whole. The fold must give what the read gives, on both backends; a
    directory deleted as a whole (v2's event names only the directory) asks for a read instead."""
    keys = JobKeys(f"folded-{backend}")
    kv = store_for(etcd_server.endpoint, backend=backend)
    reader = LiveReader(kv, keys, RequestStats(), SimpleNamespace(emit=Recorder()))

    def node(name: str) -> str:
        return NodeRecord(node_id=name, host_addr="127.0.0.1", pid=len(name)).to_json()

    def same(a: StoreView, b: StoreView) -> bool:
        return dataclasses.replace(a, etcd_index=0) == dataclasses.replace(b, etcd_index=0)

    def events_after(revision: int, until: int) -> list[tuple[str, str | None, int]]:
        watch, got = kv.watch(keys.live, revision + 1), []
        try:
            while not got or got[-1][2] < until:
                got += [(e.key, e.value, e.revision) for e in watch.wait(5).events]
        finally:
            watch.close()
        return got

    try:
        for name in ("n1", "n2"):
            kv.put(keys.node(name), node(name))
        kv.create(keys.round, Round(round=1, phase=Phase.JOINING, ts=1.0).to_json())
        base = reader.view()
        assert reader.stats.keys_read == 3  # n1, n2 and the round: a whole read counts every key it got
        kv.put(keys.node("n3"), node("n3"))
        kv.delete(keys.node("n1"))
        kv.replace(keys.round, Round(round=1, phase=Phase.FROZEN, ts=1.0, ranks={"n2": 0, "n3": 1},
                                     world_size=2).to_json(), kv.get(keys.round).mod_revision)
        kv.put(f"{keys.done(1)}/n2", DoneRecord(ts=2.0).to_json())
        kv.put(f"{keys.done(1)}/n3", DoneRecord(ts=2.0, failure="exit 3").to_json())
        kv.put(keys.node("n2"), NodeRecord(node_id="n2", host_addr="10.0.0.2", pid=7).to_json())
        kv.put(keys.node("bad"), "not a record")  # alive, its record unreadable: skipped, counted
        last = kv.put(f"{keys.done(1)}/n2", DoneRecord(ts=3.0, failure="late").to_json())
        folded = reader.fold(base, events_after(base.etcd_index, last), last)
        whole = reader.view()
        assert reader.stats.keys_read == 3 + 6  # the fold read none; the read: 3 nodes, the round, 2 done
        assert folded is not None and same(folded, whole), (folded, whole)
        assert folded.alive == {"n2", "n3", "bad"} and folded.mixed == {1: {"n2": "late", "n3": "exit 3"}}
        assert reader.fold(folded, events_after(base.etcd_index, last), last) == folded  # seen ones skipped

        kv.delete(keys.node("bad"))
        kv.delete_dir(keys.done(1))
        last = kv.put(keys.node("n4"), node("n4"))
        again = reader.fold(folded, events_after(folded.etcd_index, last), last)
        if backend == "v3":  # one delete event per key
            assert again is not None and same(again, reader.view()) and again.done == {}
        else:  # one event for the directory: only a read can tell what went
            assert again is None
    finally:
        kv.close()


def pause(watcher: LiveWatcher, put, key: str) -> None:
    """Pause, then make sure the membership watch is closed: a watch waiting for its next event sees the
    pause only once it returns, so one event is sent, and the watch closes within its 1 s pause check."""
    watcher.pause()
    put(key, "{}")
    time.sleep(1.5)


class Counting:
    """The store, with each call's name and first argument recorded in `calls`."""

    def __init__(self, kv: Store, calls: list[tuple[str, str]]) -> None:
        self.kv, self.calls = kv, calls

    def __getattr__(self, name):
        method = getattr(self.kv, name)

        def call(*args, **kw):
            self.calls.append((name, str(args[0]) if args else ""))
            return method(*args, **kw)
        return call


def rendezvous_of_b(kv: Store, keys: JobKeys, watcher, stats: RequestStats,
                    calls: list[tuple[str, str]]) -> EtcdRendezvous:
    """Node "b"'s rendezvous in a job of 2 to 3 nodes, its store calls recorded in `calls`."""
    settings = Settings(node_id="b", min_nodes=2, max_nodes=3, initial_size=2, last_call=1.0,
                        initial_wait=20.0, join_timeout=60.0, stop_grace=2.0)
    return EtcdRendezvous(Counting(kv, calls), LeaseClasses(kv), keys.job, "b", "127.0.0.1", settings,
                          SimpleNamespace(emit=Recorder()), watcher, stats,
                          StoreHealth(Recorder(), grace=5.0, slow=5.0))


def paused_behind_a(kv: Store, keys: JobKeys, watcher: LiveWatcher,
                    calls: list[tuple[str, str]]) -> tuple[EtcdRendezvous, RendezvousState]:
    """Node "b" of a job of two, joined to round 1 and waiting (paused) behind "a", its closer."""
    rdzv = rendezvous_of_b(kv, keys, watcher, watcher.stats, calls)
    for node in ("a", "b"):
        kv.put(keys.node(node), NodeRecord(node_id=node, host_addr="127.0.0.1", pid=1).to_json())
    kv.create(keys.round, Round(round=1, phase=Phase.JOINING, ts=time.time()).to_json())
    # "a" joined first, so it closes the round (decisions.closing_order: newcomers by arrival)
    kv.put(keys.round_member(1, "a"), JoinRecord(node_id="a", addr="127.0.0.1", port=1, ts=time.time(),
                                                 prev_rank=None).to_json())
    state = RendezvousState(started=time.monotonic())
    for _ in range(5):  # "b" joins, reads the members, and waits paused behind "a"
        watcher.nudge()
        info, state = rdzv._step(state, lambda _: None)
        assert info is None
        if state.ahead:
            break
    assert state.ahead == {"a"} and state.joined_round == 1
    return rdzv, state


def freeze_round_1(kv: Store, keys: JobKeys) -> int:
    """The closer's freeze of round 1, ranking "a" and "b"; its revision."""
    entry = kv.get(keys.round)
    frozen = Round(round=1, phase=Phase.FROZEN, ts=time.time(), ranks={"a": 0, "b": 1}, world_size=2,
                   master_addr="127.0.0.1", master_port=1)
    assert kv.replace(keys.round, frozen.to_json(), entry.mod_revision)
    return kv.get(keys.round).mod_revision


def test_a_paused_joiner_is_admitted_on_the_round_record_alone(etcd_server):
    """A joiner that waits for the closer reads one key when the round changes, not `live/` whole (at
    1000 nodes, a million keys per freeze), and follows `live/` from the freeze on. (Here its watcher
    never started, so no event carried the record: it reads that key.)"""
    keys = JobKeys("admitted-by-record")
    kv = store_for(etcd_server.endpoint)
    calls: list[tuple[str, str]] = []
    watcher = LiveWatcher(kv, keys.live, RequestStats(), OutageReporter("watch", Recorder()))  # not started
    try:
        rdzv, state = paused_behind_a(kv, keys, watcher, calls)
        freeze = freeze_round_1(kv, keys)
        calls.clear()
        info, state = rdzv._step(state, lambda _: None)
        assert info is not None and (info.rank, info.world_size) == (1, 2)
        assert calls == [("get", keys.round)], calls  # one key; `live/` was not listed
        assert rdzv._admitted_at == freeze
    finally:
        kv.close()


@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_a_joiner_behind_a_live_joiner_reads_a_few_keys_not_one_per_node(etcd_server, backend):
    """A mass join: 41 nodes joined before "b", "a" first. "b" reads the round, joins, reads the round's
    first join records and the heartbeat of the first one ahead of it, and waits: never `live/` whole nor
    every join record, which return one key per node (at 1000 nodes the fleet read a million keys).
    Woken with the round unchanged, it reads that heartbeat again, and the round at most: two keys."""
    with started_watcher(etcd_server, backend, f"few-keys-{backend}") as (keys, kv, stats, watcher):
        calls: list[tuple[str, str]] = []
        rdzv = rendezvous_of_b(kv, keys, watcher, stats, calls)
        others = ["a"] + [f"n{i:02d}" for i in range(40)]
        for node in [*others, "b"]:
            kv.put(keys.node(node), NodeRecord(node_id=node, host_addr="127.0.0.1", pid=1).to_json())
        kv.create(keys.round, Round(round=1, phase=Phase.JOINING, ts=time.time()).to_json())
        for node in others:
            kv.put(keys.round_member(1, node), JoinRecord(node_id=node, addr="127.0.0.1", port=1,
                                                          ts=time.time(), prev_rank=None).to_json())
        keys_before = stats.keys_read
        info, state = rdzv._step(RendezvousState(started=time.monotonic()), lambda _: None)
        assert info is None and state.joined_round == 1 and state.ahead == {"a"}
        assert calls == [("get", keys.round), ("first_created", keys.round_members(1)),
                         ("get", keys.node("a"))], calls
        assert stats.keys_read - keys_before == 1 + FIRST_JOINERS + 1
        assert kv.get(keys.round_member(1, "b")) is not None  # it did join
        calls.clear()
        info, state = rdzv._step(state, lambda _: None)  # a safety-net wake: the round has not changed
        assert info is None and state.ahead == {"a"}
        # the round from the watch's event, or one read where that has not arrived yet; then "a"'s key
        assert calls[-1] == ("get", keys.node("a")) and set(calls) <= {("get", keys.round), calls[-1]}, calls


@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_a_joiner_whose_joiner_ahead_is_gone_judges_on_the_whole_view(etcd_server, backend):
    """The proof that "b" is not the closer is a live joiner ahead of it. Once "a" is gone, none is left,
    so "b" reads `live/` and the join records whole, and finds that it closes the round itself."""
    with started_watcher(etcd_server, backend, f"ahead-gone-{backend}") as (keys, kv, stats, watcher):
        calls: list[tuple[str, str]] = []
        rdzv, state = paused_behind_a(kv, keys, watcher, calls)
        kv.delete(keys.node("a"))
        calls.clear()
        info, state = rdzv._step(state, lambda _: None)
        assert info is None and state.ahead == frozenset()  # nobody ahead: it is the closer now
        assert ("list", keys.live) in calls and ("list", keys.round_members(1)) in calls, calls
        assert state.members is not None and set(state.members.records) == {"a", "b"}
        calls.clear()
        info, state = rdzv._step(state, lambda _: None)  # the closer stays on the whole view
        assert info is None and state.ahead == frozenset()
        assert ("list", keys.live) in calls and not any(name == "first_created" for name, _ in calls), calls


class SlowRound(Counting):
    """The store, with every read of `live/round` answered `delay` seconds late, as in an etcd stall."""

    def __init__(self, kv: Store, calls: list[tuple[str, str]], round_key: str, delay: float) -> None:
        super().__init__(kv, calls)
        self.round_key, self.delay = round_key, delay

    def get(self, key: str):
        if key == self.round_key:
            time.sleep(self.delay)
        return self.kv.get(key)


def test_a_stall_met_on_the_round_record_leaves_no_absence_trusted(etcd_server):
    """A node outside a frozen round whose first read, the round record, waited out an etcd stall must
    not trust the heartbeats it reads next: the stall expired them, and their holders re-assert them a
    moment later. The soak caught a node that opened a new round then, "all members of the previous
    round lost", and a step was redone. Every read of a step is timed for the store's health, so a slow
    one unsettles the view, as a slow whole read always did."""
    keys = JobKeys("stall-on-round")
    kv = store_for(etcd_server.endpoint)
    try:
        kv.put(keys.node("b"), NodeRecord(node_id="b", host_addr="127.0.0.1", pid=1).to_json())
        frozen = Round(round=4, phase=Phase.FROZEN, ts=time.time(), ranks={"a": 0, "c": 1}, world_size=2,
                       master_addr="127.0.0.1", master_port=1)  # its members' heartbeats: expired
        kv.create(keys.round, frozen.to_json())
        health = StoreHealth(Recorder(), grace=5.0, slow=0.1)
        watcher = SimpleNamespace(round_seen=lambda: None, pause=lambda: None, resume=lambda after=None: None,
                                  wait=lambda timeout: False, take=lambda: ([], False))
        settings = Settings(node_id="b", min_nodes=1, max_nodes=3, initial_size=1, last_call=1.0,
                            initial_wait=1.0, join_timeout=60.0, stop_grace=2.0)
        rdzv = EtcdRendezvous(SlowRound(kv, [], keys.round, 0.3), LeaseClasses(kv), keys.job, "b",
                              "127.0.0.1", settings, SimpleNamespace(emit=Recorder()), watcher,
                              RequestStats(), health)
        info, _ = rdzv._step(RendezvousState(started=time.monotonic()), lambda _: None)
        assert info is None and not health.settled()
        assert Round.from_json(kv.get(keys.round).value).round == 4  # no new round: it waits to settle
    finally:
        kv.close()


@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_a_paused_joiner_woken_by_the_freeze_is_admitted_without_a_request(etcd_server, backend):
    """The freeze's watch event carries the round record, so the joiners it wakes need no read at all: at
    1000 nodes, 1000 reads of the whole rank table fewer, all in the same instant."""
    with started_watcher(etcd_server, backend, "admitted-by-event") as (keys, kv, stats, watcher):
        calls: list[tuple[str, str]] = []
        rdzv, state = paused_behind_a(kv, keys, watcher, calls)
        freeze = freeze_round_1(kv, keys)
        wait_for(lambda: (seen := watcher.round_seen()) is not None and seen.revision == freeze, 5,
                 what="the freeze's event")
        calls.clear()
        reads = stats.reads
        info, state = rdzv._step(state, lambda _: None)
        assert info is not None and (info.rank, info.world_size) == (1, 2)
        assert (calls, stats.reads - reads) == ([], 0)  # no request
        assert rdzv._admitted_at == freeze  # and it follows `live/` from the freeze on, as after a read


def test_an_older_rounds_event_never_admits_a_joiner(etcd_server):
    """The newest round event a watch reported can be of a round before the one this node joined (it was
    ranked in round 1, then joined round 2): that record ranks it but must not admit it. It reads the key."""
    keys = JobKeys("older-round-event")
    kv = store_for(etcd_server.endpoint)
    calls: list[tuple[str, str]] = []
    old = Round(round=1, phase=Phase.FROZEN, ts=time.time(), ranks={"a": 0, "b": 1}, world_size=2,
                master_addr="127.0.0.1", master_port=1)
    watcher = SimpleNamespace(round_seen=lambda: Event("put", keys.round, old.to_json(), 7))
    rdzv = rendezvous_of_b(kv, keys, watcher, RequestStats(), calls)
    try:
        kv.create(keys.round, Round(round=2, phase=Phase.JOINING, ts=time.time()).to_json())
        assert rdzv._round_now(joined=1)[0] == old  # the round it joined: the event is enough
        calls.clear()
        rnd, _ = rdzv._round_now(joined=2)
        assert (rnd.round, rnd.phase, calls) == (2, Phase.JOINING, [("get", keys.round)])
    finally:
        kv.close()


class CompactingStore:
    """Just what LiveWatcher calls: the first wait on each watch finds its history compacted."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, int]] = []

    def revision(self, directory: str = "/") -> int:
        return 100 + len(self.opened)

    def watch(self, directory: str, start_revision: int):
        return self._open(directory, start_revision)

    def watch_key(self, key: str, start_revision: int):
        return self._open(key, start_revision)

    def _open(self, key: str, start: int):
        from petctl.core.store import Batch, Compacted

        first = not any(k == key for k, _ in self.opened)
        self.opened.append((key, start))

        class W:
            closed = threading.Event()
            requests = 0

            def wait(self, timeout: float):
                if first:
                    raise Compacted(50)
                self.closed.wait(timeout)
                return Batch((), start - 1)

            def close(self) -> None:
                self.closed.set()

        return W()


class OneRoundEventStore(CompactingStore):
    """The round watch's first opening reports one round event, then (once `go` is set) finds its history
    compacted; every other watch waits quietly."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def _open(self, key: str, start: int):
        from petctl.core.store import Batch, Compacted

        first = key.endswith("/round") and not any(k == key for k, _ in self.opened)
        self.opened.append((key, start))
        go = self.go

        class W:
            closed = threading.Event()
            requests = 1
            sent = False

            def wait(self, timeout: float):
                if first and not self.sent:
                    self.sent = True
                    return Batch((Event("put", key, "{}", start),), start)
                if first:
                    go.wait(timeout)
                    if go.is_set():
                        raise Compacted(50)
                    return Batch((), start)
                self.closed.wait(timeout)
                return Batch((), start - 1)

            def close(self) -> None:
                self.closed.set()

        return W()


def test_the_round_event_a_joiner_may_use_is_forgotten_when_the_round_watch_starts_again():
    """After the round watch reopens from a fresh read (a compaction here; also an outage, or a wiped
    store whose revisions start again), what it reported before is not offered to a joiner as the round:
    only a new event, or a read."""
    kv, rec = OneRoundEventStore(), Recorder()
    watcher = LiveWatcher(kv, "/petctl/jobs/c/live", RequestStats(), OutageReporter("watch", rec))
    watcher.start()
    try:
        wait_for(lambda: watcher.round_seen() is not None, 5, what="the round event")
        assert watcher.round_seen().key == "/petctl/jobs/c/live/round"
        kv.go.set()
        wait_for(lambda: [k for k, _ in kv.opened].count("/petctl/jobs/c/live/round") == 2, 5,
                 what="the round watch reopened")
        wait_for(lambda: watcher.round_seen() is None, 5, what="the old event forgotten")
    finally:
        watcher.stop()
    assert rec.events == []


def test_a_compacted_watch_starts_again_from_a_fresh_read_and_is_no_failure():
    kv, rec = CompactingStore(), Recorder()
    watcher = LiveWatcher(kv, "/petctl/jobs/c/live", RequestStats(), OutageReporter("watch", rec))
    watcher.start()
    wait_for(lambda: len(kv.opened) >= 4, 5, what="both watches opened again")
    watcher.stop()
    keys = [k for k, _ in kv.opened]
    assert sorted(keys[:4]) == sorted(["/petctl/jobs/c/live"] * 2 + ["/petctl/jobs/c/live/round"] * 2)
    assert all(start > 100 for _, start in kv.opened)  # each from a fresh read's revision + 1
    assert watcher.outage.failures == 0 and rec.events == []


@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_watcher_failures_are_counted_and_reported_once(tmp_path, backend):
    client = store_for(f"http://127.0.0.1:{free_port()}", backend=backend, timeout=0.5)  # nobody listens
    rec = Recorder()
    watcher = LiveWatcher(client, "/petctl/jobs/x/live", RequestStats(), OutageReporter("watch", rec))
    watcher.start()
    wait_for(lambda: watcher.outage.failures >= 4, 15, what="failed polls")
    watcher.stop()
    client.close()
    assert rec.names() == ["watch.failing"], rec.events  # four failures, reported once
    assert "StoreUnavailable: revision via /petctl/jobs/x/live" in rec.events[0][1]["error"]


# --- a crash is never silent ---------------------------------------------------------------------------
@pytest.fixture
def cluster(etcd_server, tmp_path):
    made: list[AgentCluster] = []

    def make(name: str, **kw) -> AgentCluster:
        spec = make_spec(name, etcd_server.endpoint, min_size=1, max_size=1, heartbeat_ttl=30.0, **kw)
        c = AgentCluster(etcd_server.endpoint, tmp_path / name, spec,
                         status_url=f"file://{tmp_path / 'mirror'}")
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop_all()


def mirrored_events(mirror: Path, node: str) -> list[dict]:
    chunks = sorted(p for p in (mirror / "events" / node).iterdir() if not p.name.startswith("."))
    return [json.loads(line) for p in chunks for line in p.read_text().splitlines()]


@pytest.mark.slow
def test_an_early_crash_is_one_event_everywhere_and_exit_70(cluster, tmp_path):
    c = cluster("crash-early")
    c.spec.code_url = f"file://{tmp_path / 'no-such-script.py'}"
    c.spec.warm_workers = False
    node = c.start()
    assert node.proc.wait(timeout=60) == 70
    (crash,) = node.events("agent.crashed")
    assert crash["error"].startswith("FileNotFoundError:") and "\n" not in crash["error"]
    # The traceback travels with the event (its last lines), so the cause outlives the instance's log.
    assert crash["traceback"][-1].startswith("FileNotFoundError:") and len(crash["traceback"]) <= 20
    assert any("fetch_code" in line for line in crash["traceback"])
    # The services started before the crash were stopped properly: the event sink drained into etcd and
    # the mirror's final flush ran.
    with closing(store_for(c.endpoint, backend=c.spec.etcd_store)) as store:
        listing = store.list(JobKeys(c.spec.name).events)
    assert "agent.crashed" in [json.loads(entry.value)["event"] for entry in listing.entries]
    assert "agent.crashed" in [e["event"] for e in mirrored_events(tmp_path / "mirror", node.node_id)]


@pytest.mark.slow
def test_a_crash_in_the_rendezvous_stops_the_heartbeat_at_once(cluster):
    c = cluster("crash-rdzv")
    keys = JobKeys(c.spec.name)
    client = store_for(c.endpoint, backend=c.spec.etcd_store)
    client.put(keys.round, "this is not a round")  # only a bug or a foreign writer could do this
    c.spec.warm_workers = False
    node = c.start()
    wait_for(lambda: node.events("agent.crashed"), 60, what="agent.crashed")
    assert node.proc.wait(timeout=30) == 70
    (crash,) = node.events("agent.crashed")
    assert crash["error"].startswith("WireFormatError: Round: not JSON")
    # Its heartbeat (TTL 30 s) was deleted on the way out, so the others would not wait for it.
    assert client.get(keys.node(node.node_id)) is None
    client.close()


@pytest.mark.parametrize("left,budget", [
    (120.0, 100.0),  # a spot notice: the full 15 s margin, capped by save_deadline (100 s here)
    (60.0, 45.0),
    (30.0, 22.5),  # from here on a quarter of the time left is the margin
    (6.0, 4.5),  # a short local notice: the save gets 4.5 s, not 1 s
    (0.5, 1.0),  # (almost) no time: 1 s, whatever happens
])
def test_a_short_notice_keeps_most_of_its_time_for_the_save(left, budget):
    from petctl.agent.notices import save_budget

    assert save_budget(left, save_deadline=100.0) == pytest.approx(budget)


# --- the lease classes --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["v2", "v3"])
def test_a_lease_class_rotates_after_its_ttl_and_replaces_a_lease_found_gone(etcd_server, backend):
    """Keys written with a TTL live under their class's lease: the same one for `ttl` seconds, then a new
    one (the old is not revoked: its keys stay); a lease gone under it (revoked here, as a wipe would)
    is replaced and the write goes through."""
    now = [0.0]
    keys = JobKeys(f"classes-{backend}")
    with closing(store_for(etcd_server.endpoint, backend=backend)) as kv:
        kv.delete_dir(keys.base)
        leases = LeaseClasses(kv, clock=lambda: now[0])
        first = leases.lease(60)
        assert leases.lease(60) is first and leases.lease(120) is not first  # one lease per class
        leases.put(keys.node_status("a"), "1", 60)
        now[0] = 60.0
        second = leases.lease(60)
        assert second is not first and kv.get(keys.node_status("a")).value == "1"  # not revoked
        second.revoke()
        leases.put(keys.node_status("b"), "2", 60)
        leases.put(keys.event("b", 1), "e", 60, new=True)
        leases.put(keys.node_status("b"), "3", 60, new=True)  # there after all: written over
        assert kv.get(keys.node_status("b")).value == "3" and kv.get(keys.event("b", 1)).value == "e"
        assert leases.lease(60) is not second
