"""The agent's services: outages reported once each way and counted, a watcher that stops promptly, and a
crash that is never silent (one `agent.crashed` event, exit 70, services stopped on the way out)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import etcd
import pytest

from petctl.agent.health import OutageReporter, describe
from petctl.agent.liveness import Heartbeat
from petctl.agent.rendezvous import LiveWatcher, RequestStats
from petctl.agent.reporting import EtcdEventSink
from petctl.core.keys import JobKeys
from petctl.core.records import NodeRecord
from petctl.io.etcd import etcd_client, free_port
from tests.support.agent_harness import AgentCluster, make_spec, wait_for
from tests.support.emitter import Recorder


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


class FlakyClient:
    """Fails `failures` calls with etcd's connection error, then works; records what it was asked."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[str] = []

    def _maybe_fail(self, what: str) -> None:
        self.calls.append(what)
        if self.failures > 0:
            self.failures -= 1
            raise etcd.EtcdConnectionFailed("connection refused")

    def write(self, key, value, **kw):
        self._maybe_fail("write")

    def refresh(self, key, ttl=None):
        self._maybe_fail("refresh")

    def delete(self, key):
        self._maybe_fail("delete")


def test_heartbeat_refresh_failures_are_counted_and_reported_once():
    rec = Recorder()
    client = FlakyClient(0)
    beat = Heartbeat(client, JobKeys("j"), NodeRecord(node_id="n1", host_addr="h", pid=1), interval=0.02,
                     ttl=3, outage=OutageReporter("heartbeat", rec))
    beat.start()
    client.failures = 4
    wait_for(lambda: client.failures == 0 and "heartbeat.recovered" in rec.names(), 5, what="recovery")
    beat.stop(delete=True)
    beat.stop(delete=True)  # idempotent: one delete
    assert rec.names() == ["heartbeat.failing", "heartbeat.recovered"]
    assert beat.outage.failures == 4 and client.calls.count("delete") == 1 and beat.reasserted == 0


def test_event_sink_counts_what_it_could_not_write():
    rec = Recorder()
    sink = EtcdEventSink(FlakyClient(3), "/k", OutageReporter("events", rec))
    sink.start()
    for i in range(5):
        sink({"event": "e", "i": i})
    sink.stop()
    assert sink.dropped == 3 and rec.names() == ["events.failing", "events.recovered"]


# --- the watcher --------------------------------------------------------------------------------------
def test_watcher_wakes_on_live_events_and_stops_at_once_mid_poll(etcd_server):
    keys = JobKeys("watched")
    client = etcd_client(etcd_server.endpoint)
    client.write(keys.node("n0"), "{}")
    stats, rec = RequestStats(), Recorder()
    watcher = LiveWatcher(etcd_server.endpoint, keys.live, stats, OutageReporter("watch", rec),
                          poll_timeout=30)
    watcher.start()
    assert watcher.wait(5)  # the first read wakes the agent for a fresh snapshot
    time.sleep(0.3)
    watcher.changed.clear()
    client.write(keys.node("n1"), "{}")
    assert watcher.wait(5), "a heartbeat under live/ wakes the watcher"
    time.sleep(0.3)  # both threads are now blocked in their 30 s long polls
    t0 = time.monotonic()
    watcher.stop()
    assert time.monotonic() - t0 < 1.0
    assert not any(t.is_alive() for t in watcher._threads)
    assert stats.watches >= 2 and rec.events == []


def test_watcher_failures_are_counted_and_reported_once(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    rec = Recorder()
    watcher = LiveWatcher(endpoint, "/petctl/jobs/x/live", RequestStats(), OutageReporter("watch", rec))
    watcher.start()
    wait_for(lambda: watcher.outage.failures >= 4, 10, what="failed polls")
    watcher.stop()
    assert rec.names() == ["watch.failing"] and "refused" in rec.events[0][1]["error"].lower()


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
    listing = etcd_client(c.endpoint).read(JobKeys(c.spec.name).events, recursive=True, sorted=True)
    assert "agent.crashed" in [json.loads(leaf.value)["event"] for leaf in listing.leaves if leaf.value]
    assert "agent.crashed" in [e["event"] for e in mirrored_events(tmp_path / "mirror", node.node_id)]


@pytest.mark.slow
def test_a_crash_in_the_rendezvous_stops_the_heartbeat_at_once(cluster):
    c = cluster("crash-rdzv")
    keys = JobKeys(c.spec.name)
    client = etcd_client(c.endpoint)
    client.write(keys.round, "this is not a round")  # only a bug or a foreign writer could do this
    c.spec.warm_workers = False
    node = c.start()
    wait_for(lambda: node.events("agent.crashed"), 60, what="agent.crashed")
    assert node.proc.wait(timeout=30) == 70
    (crash,) = node.events("agent.crashed")
    assert crash["error"].startswith("WireFormatError: Round: not JSON")
    # Its heartbeat (TTL 30 s) was deleted on the way out, so the others would not wait for it.
    with pytest.raises(etcd.EtcdKeyNotFound):
        client.read(keys.node(node.node_id))


@pytest.mark.parametrize("left,budget", [
    (120.0, 100.0),  # a spot notice: the full 15 s margin, capped by preempt_deadline (100 s here)
    (60.0, 45.0),
    (30.0, 22.5),  # from here on a quarter of the time left is the margin
    (6.0, 4.5),  # a short local notice: the save gets 4.5 s, not 1 s
    (0.5, 1.0),  # (almost) no time: 1 s, whatever happens
])
def test_a_short_notice_keeps_most_of_its_time_for_the_save(left, budget):
    from petctl.agent.notices import save_budget

    assert save_budget(left, preempt_deadline=100.0) == pytest.approx(budget)
