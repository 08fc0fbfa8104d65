"""Cost hygiene of the agents' mirror: each upload holds only what is new (append-only chunks), the
readers reassemble exactly what was written, and the bucket keeps noncurrent versions one day.

The writer is the agent's own `Mirror` talking to moto's S3 through boto3 (as on an instance, with
AWS_ENDPOINT_URL pointing at the emulator); the bytes it sends are counted on the client's PutObject
calls."""

from __future__ import annotations

import io
import json
import time
import uuid

import pytest

from petctl.agent.reporting import Mirror
from petctl.core.eventlog import parse_lines
from petctl.core.mirrorchunks import ChunkKey, by_node, chunk_name
from petctl.io.eventlog import EventLog
from petctl.io.objstore import ObjectStoreError, open_object_store
from petctl.jobview.prefix import StorePrefix, follow_chunks, log_nodes, merge, mirror_events
from petctl.providers.aws.storage import JobStore
from tests.aws import rendered
from tests.support.aws.account import boto


@pytest.fixture
def bucket(moto, monkeypatch) -> str:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto)  # what the instance's boto3 would use for AWS itself
    name = f"mirror-{uuid.uuid4().hex[:10]}"
    s3 = boto(moto, "s3")
    s3.create_bucket(Bucket=name)
    s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


class PutCounter:
    """Bytes of every PutObject body the mirror's client sends, per key."""

    def __init__(self, mirror: Mirror) -> None:
        self.puts: list[tuple[str, int]] = []
        mirror.store.put_bytes("status/_probe.json", b"{}")  # creates the lazy client
        mirror.store.client.meta.events.register("provide-client-params.s3.PutObject", self._count)

    def _count(self, params, **_) -> None:
        self.puts.append((params["Key"], len(params["Body"])))

    def take(self) -> int:
        total = sum(size for _, size in self.puts)
        self.puts.clear()
        return total


def log_lines(store: JobStore, node: str) -> list[str]:
    """One node's mirrored log, read as `petctl logs --node` reads it."""
    return list(follow_chunks(store, node, follow=False, running=lambda: False, interval=0))


def event(i: int) -> dict:
    return {"ts": 1000.0 + i, "event": "train.step", "node": "i-1", "step": i}


def test_each_upload_is_proportional_to_the_new_lines_not_to_the_file(bucket, tmp_path, moto):
    log = tmp_path / "node.log"
    log.write_text("")
    mirror = Mirror(f"s3://{bucket}/jobs/demo/", "i-1", log, interval=3600)
    counter = PutCounter(mirror)
    counter.take()
    written_log, all_events, sent = b"", [], []
    for interval in range(6):
        new_lines = "".join(f"step {interval}.{j} loss=0.{j:04d} ünïcode\n" for j in range(50)).encode()
        with open(log, "ab") as f:
            f.write(new_lines)
        written_log += new_lines
        new_events = [event(interval * 10 + j) for j in range(10)]
        for e in new_events:
            mirror.add_event(e)
        all_events += new_events
        mirror.set_status({"node_id": "i-1", "state": "running", "step": interval})
        mirror.flush()
        new_event_bytes = sum(len(json.dumps(e) + "\n") for e in new_events)
        status_bytes = len(json.dumps({"node_id": "i-1", "state": "running", "step": interval}))
        sent.append(counter.take())
        assert sent[-1] == len(new_lines) + new_event_bytes + status_bytes  # exactly the news, nothing old
    assert max(sent) - min(sent) < 100  # flat over time while the file grew 6x
    assert sent[-1] * 4 < len(written_log)  # the old layout re-sent at least the whole log every time
    mirror.flush()  # nothing new: nothing sent (the unchanged status included)
    assert counter.take() == 0

    store = JobStore(boto(moto, "s3"), bucket, "demo")
    assert log_nodes(store) == ["i-1"]
    assert "\n".join(log_lines(store, "i-1")) + "\n" == written_log.decode()  # exact, in order
    assert sorted(mirror_events(store), key=lambda e: e["ts"]) == all_events == mirror_events(store)
    assert read_events("demo", mirror_url=f"s3://{bucket}/jobs/demo/") == all_events
    versions = boto(moto, "s3").list_object_versions(Bucket=bucket, Prefix="jobs/demo/events/")
    assert len(versions["Versions"]) == 6  # one object per interval, none rewritten


def test_a_restarted_agent_continues_the_log_and_never_overwrites_chunks(bucket, tmp_path, moto):
    log = tmp_path / "node.log"
    log.write_bytes(b"first life\n")
    first = Mirror(f"s3://{bucket}/jobs/demo/", "i-1", log, interval=3600)
    first.add_event(event(1))
    first.flush()
    with open(log, "ab") as f:  # the restarted agent appends to the same log
        f.write(b"second life\n")
    second = Mirror(f"s3://{bucket}/jobs/demo/", "i-1", log, interval=3600)
    second.epoch_ms = first.epoch_ms + 1
    counter = PutCounter(second)
    counter.take()
    second.add_event(event(2))
    second.flush()
    assert counter.take() == len(b"second life\n") + len(json.dumps(event(2)) + "\n")  # not the first life
    store = JobStore(boto(moto, "s3"), bucket, "demo")
    assert list(log_lines(store, "i-1")) == ["first life", "second life"]
    assert [e["step"] for e in mirror_events(store)] == [1, 2]


def test_upload_failures_are_retried_without_loss_and_reported_once_each_way(tmp_path):
    stream = io.StringIO()
    mirror = Mirror(f"file://{tmp_path / 'mirror'}", "i-1", None, interval=3600,
                    log=EventLog("agent", stream=stream))
    real_put, failing = mirror.store.put_bytes, {"left": 3}

    def flaky(key, data, content_type=""):
        if failing["left"]:
            failing["left"] -= 1
            raise ObjectStoreError("cannot write: endpoint unreachable")
        real_put(key, data, content_type)

    mirror.store.put_bytes = flaky
    stored = []
    for i in range(5):
        mirror.add_event(event(i))
        stored.append(mirror.flush())
    assert stored == [False, False, False, True, True]
    assert mirror.failures == 3  # every failed attempt counts, and the count stays (node status)
    reports = [e for e in parse_lines(stream.getvalue().splitlines()) if e["event"].startswith("mirror.")]
    assert [e["event"] for e in reports] == ["mirror.outage", "mirror.recovered"]
    assert "ObjectStoreError: cannot write" in reports[0]["error"] and reports[1]["failed_attempts"] == 3
    mirrored = read_events("demo", mirror_url=f"file://{tmp_path / 'mirror'}")
    assert [e["step"] for e in mirrored] == [0, 1, 2, 3, 4]


def test_an_agent_without_access_reports_the_outage_and_keeps_the_result_for_later(tmp_path):
    """No write access at all (a prefix under a plain file stands in for a denied bucket; the tests may run
    as root, who ignores permissions): the outage is one event, not one per interval, and the job's result
    is written once the prefix works."""
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    prefix = blocker / "mirror"
    mirror = Mirror(f"file://{prefix}", "i-1", None, interval=0.05)  # its own log: stderr + the mirror
    try:
        mirror.start()
        mirror.add_event(event(1))
        assert not mirror.put_result({"state": "succeeded", "reason": "done"})
        deadline = time.monotonic() + 10
        while mirror.failures < 4:  # the thread keeps trying, every interval
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        blocker.unlink()  # access restored
        mirror.stop()
    assert json.loads((prefix / "result.json").read_text())["state"] == "succeeded"
    names = [e["event"] for e in read_events("demo", mirror_url=f"file://{prefix}")]
    assert names.count("mirror.outage") == 1 and names.count("mirror.recovered") == 1
    assert "train.step" in names


def test_concurrent_flushes_lose_and_repeat_nothing(tmp_path):
    """The agent flushes (and writes the result) while the mirror's thread flushes: every write goes
    through one flush at a time, so each event and log byte is stored exactly once."""
    log = tmp_path / "node.log"
    log.write_bytes(b"")
    mirror = Mirror(f"file://{tmp_path / 'mirror'}", "i-1", log, interval=0.001,
                    log=EventLog("agent", stream=io.StringIO()))
    mirror.start()
    written = b""
    for i in range(300):
        mirror.add_event(event(i))
        line = f"line {i}\n".encode()
        with open(log, "ab") as f:
            f.write(line)
        written += line
        mirror.set_status({"node_id": "i-1", "step": i})
        if i % 3 == 0:
            mirror.flush()
        if i == 150:
            assert mirror.put_result({"state": "succeeded", "reason": "done"})
    mirror.stop()
    assert mirror.failures == 0
    mirrored = read_events("demo", mirror_url=f"file://{tmp_path / 'mirror'}")
    assert [e["step"] for e in mirrored] == list(range(300))
    store = mirror.store
    chunks = by_node([o.key for o in store.list("logs/")], "logs")["i-1"]
    assert b"".join(store.get_bytes(k.name) for k in chunks) == written
    assert json.loads(store.get_bytes("status/i-1.json"))["step"] == 299
    assert json.loads(store.get_bytes("result.json"))["state"] == "succeeded"


def test_chunk_names_sort_in_write_order_and_legacy_objects_still_read():
    names = [chunk_name("logs", "i-1", 1700000000123, 10), chunk_name("logs", "i-1", 1700000000123, 9),
             chunk_name("logs", "i-1", 1700000000999, 0), "logs/i-1.log", "logs/i-2/junk.txt",
             chunk_name("events", "i-1", 1, 0)]
    order = by_node(names, "logs")
    assert list(order) == ["i-1"]
    assert [(k.epoch_ms, k.seq) for k in order["i-1"]] == [(-1, 0), (1700000000123, 9), (1700000000123, 10),
                                                          (1700000000999, 0)]
    assert ChunkKey.parse("events/i-1/0000000000001-00000000.log") is None  # wrong suffix for the stream
    with pytest.raises(ValueError):
        chunk_name("status", "i-1", 0, 0)


def test_bucket_keeps_noncurrent_versions_one_day():
    bucket = rendered.resources(rendered.parse(rendered.base_template()), "AWS::S3::Bucket")
    (props,) = [r["Properties"] for r in bucket.values()]
    rules = {r["Id"]: r for r in props["LifecycleConfiguration"]["Rules"]}
    noncurrent = rules["expire-noncurrent-versions"]
    assert noncurrent["Status"] == "Enabled" and "Prefix" not in noncurrent and "TagFilters" not in noncurrent
    assert noncurrent["NoncurrentVersionExpiration"] == {"NoncurrentDays": 1}  # logs, events, checkpoints
    assert noncurrent["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}
    assert rules["remove-expired-delete-markers"]["ExpiredObjectDeleteMarker"] is True


def read_events(job: str, mirror_url: str) -> list[dict]:
    """The job's mirrored events as `petctl events` merges them (de-duplicated, in time order)."""
    return merge(mirror_events(StorePrefix(open_object_store(mirror_url))))
