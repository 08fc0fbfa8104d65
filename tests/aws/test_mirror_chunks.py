"""Cost hygiene of the agents' mirror: each upload holds only what is new (append-only chunks), the
readers reassemble exactly what was written, and the bucket keeps noncurrent versions one day.

The writer is the agent's own `Mirror` talking to moto's S3 through boto3 (as on an instance, with
AWS_ENDPOINT_URL pointing at the emulator); the bytes it sends are counted on the client's PutObject
calls."""

from __future__ import annotations

import json
import uuid

import pytest

from petctl.agent.mirror import Mirror
from petctl.core.mirrorchunks import ChunkKey, by_node, chunk_name
from petctl.jobview.events import mirror_events
from petctl.jobview.logs import follow_chunks, log_nodes
from petctl.providers.aws.storage import JobStore
from petctl.timeline import read_events
from tests.aws import rendered
from tests.aws.conftest import boto


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
        mirror.writer.put("status/_probe.json", b"{}")  # creates the lazy client
        mirror.writer._client.meta.events.register("provide-client-params.s3.PutObject", self._count)

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
    reports: list[str] = []
    mirror = Mirror(f"file://{tmp_path / 'mirror'}", "i-1", None, interval=3600, report=reports.append)
    real_put, failing = mirror.writer.put, {"left": 3}

    def flaky(key, data, content_type="application/json"):
        if failing["left"]:
            failing["left"] -= 1
            raise ConnectionError("endpoint unreachable")
        real_put(key, data, content_type)

    mirror.writer.put = flaky
    for i in range(5):
        mirror.add_event(event(i))
        mirror.flush()
    assert mirror.failures == 0 and mirror.total_failures == 3
    assert len(reports) == 2
    assert "failing (ConnectionError" in reports[0] and "recovered after 3" in reports[1]
    mirrored = read_events("demo", mirror_url=f"file://{tmp_path / 'mirror'}")
    assert [e["step"] for e in mirrored] == [0, 1, 2, 3, 4]


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
