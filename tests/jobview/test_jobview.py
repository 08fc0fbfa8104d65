"""The read side over a job's two copies of its records: the agents' mirror (a real directory) and
etcd (a real server). Corrupt records are skipped and counted, never fatal; events read from several
copies count once; the state falls back to the mirror when etcd does not answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from petctl.core.errors import ProviderError
from petctl.core.keys import JobKeys
from petctl.core.mirrorchunks import chunk_name
from petctl.core.records import JobResult, NodeRecord, NodeStatus, Phase, Round
from petctl.core.store import BACKENDS, Backend
from petctl.jobview.live import JobState, read_job_state, state_from_mirror
from petctl.jobview.prefix import Corrupt, etcd_events, file_prefix, follow_chunks, merge, mirror_events
from petctl.jobview.view import JobSources, JobView

UNREACHABLE = "http://127.0.0.1:9"  # discard: nothing answers there


def ev(ts: float, event: str, node: str, **fields) -> dict:
    return {"ts": ts, "event": event, "node": node, **fields}


def write(root: Path, name: str, data: bytes | str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def lines(*events: dict) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


@pytest.fixture
def mirror(tmp_path: Path) -> Path:
    """A job's mirror as two agents left it: chunked events and logs, statuses, one torn record each."""
    root = tmp_path / "mirror"
    write(root, chunk_name("events", "i-a", 1_700_000_000_000, 0), lines(ev(1, "agent.started", "i-a")))
    write(root, chunk_name("events", "i-a", 1_700_000_000_000, 1),
          lines(ev(3, "rendezvous.complete", "i-a", round=1)) + '{"ts": 4, "event": "torn\n')
    write(root, "events/i-b.jsonl", lines(ev(2, "agent.started", "i-b")))  # an older agent's layout
    write(root, chunk_name("logs", "i-a", 1_700_000_000_000, 0), "hello\nstep 1 ünï")
    write(root, chunk_name("logs", "i-a", 1_700_000_000_000, 1), "code\nbye\n")
    for rank, node in enumerate(("i-a", "i-b")):
        status = NodeStatus(node_id=node, state="running", updated=5.0, round=1, rank=rank, world_size=2,
                            failures={"mirror": 2} if rank else {})
        write(root, f"status/{node}.json", status.to_json())
    write(root, "status/i-c.json", '{"node_id": "i-c"}')  # no state, no updated: not a NodeStatus
    return root


def test_events_from_every_copy_count_once_in_time_order(mirror: Path) -> None:
    corrupt = Corrupt()
    from_mirror = mirror_events(file_prefix(mirror), corrupt)
    assert [e["event"] for e in sorted(from_mirror, key=lambda e: e["ts"])] == [
        "agent.started", "agent.started", "rendezvous.complete"]
    assert corrupt.to_dict() == {"event": 1}
    from_etcd = [ev(3, "rendezvous.complete", "i-a", round=1), ev(6, "job.result", "i-a")]
    merged = merge(from_etcd, from_mirror, [ev(0.5, "instance.launched", "")])
    assert [(e["ts"], e["event"]) for e in merged] == [
        (0.5, "instance.launched"), (1, "agent.started"), (2, "agent.started"),
        (3, "rendezvous.complete"), (6, "job.result")]


def test_logs_are_reassembled_across_chunks(mirror: Path) -> None:
    def read(node):
        return list(follow_chunks(file_prefix(mirror), node, follow=False, running=lambda: False, interval=0))

    assert read("i-a") == ["hello", "step 1 ünïcode", "bye"]
    assert read(None) == ["[i-a] hello", "[i-a] step 1 ünïcode", "[i-a] bye"]


def test_state_from_the_mirror_skips_and_counts_a_corrupt_status(mirror: Path) -> None:
    corrupt = Corrupt()
    state = state_from_mirror("demo", file_prefix(mirror), corrupt)
    assert state.source == "mirror" and state.state == "running" and state.ranks == {"i-a": 0, "i-b": 1}
    assert state.nodes["i-b"].failures == {"mirror": 2} and "i-c" not in state.nodes
    assert corrupt.to_dict() == {"node status": 1} and "missing field 'state'" in corrupt.note()
    write(mirror, "result.json", "not json")  # a result, however torn, still ends the job
    ended = state_from_mirror("demo", file_prefix(mirror))
    assert ended.state == "unknown" and "unreadable result record" in ended.result.reason
    write(mirror, "result.json", JobResult(state="succeeded", reason="done", ts=7.0).to_json())
    assert state_from_mirror("demo", file_prefix(mirror)).state == "succeeded"


@pytest.mark.parametrize("backend", BACKENDS)
def test_etcd_state_with_typed_records(etcd_server, mirror: Path, backend: Backend) -> None:
    """The same records read back through either store backend (the one the job's agents write with)."""
    from contextlib import closing

    from tests.support.store import store_for

    with closing(store_for(etcd_server.endpoint, backend=backend)) as store:
        keys = JobKeys("typed")
        store.delete_dir(keys.base)  # the other backend's run left nothing here (etcd 3.5: two keyspaces)
        store.put(keys.round, Round(round=3, phase=Phase.FROZEN, ts=1.0, ranks={"n1": 0, "n2": 1},
                                    world_size=2, restarts=1).to_json())
        for node in ("n1", "n2", "n3"):
            store.put(keys.node(node), NodeRecord(node_id=node, host_addr="10.0.0.1", pid=42).to_json())
        store.put(keys.node_status("n1"), NodeStatus(node_id="n1", state="running", updated=2.0, rank=0,
                                                     failures={"etcd": 4}).to_json())
        store.put(keys.node_status("n2"), "[1, 2]")  # not an object: skipped, counted
        store.put(keys.event("n1", 2), json.dumps(ev(1, "agent.started", "n1")))
        store.put(keys.event("n1", 1), json.dumps(ev(0.5, "agent.booted", "n1")))  # earlier key: first
        store.put(keys.event("n2", 3), "garbage")
        corrupt = Corrupt()
        state = read_job_state(store, "typed", corrupt)
        assert state.state == "running" and state.ranks == {"n1": 0, "n2": 1} and state.round.restarts == 1
        assert state.nodes["n1"].failures == {"etcd": 4}
        assert state.nodes["n2"].state == "" and state.nodes["n2"].pid == 42  # alive, its status unreadable
        assert set(state.nodes) == {"n1", "n2", "n3"}
        assert [e["event"] for e in etcd_events(store, "typed", corrupt)] == ["agent.booted", "agent.started"]
        assert corrupt.to_dict() == {"event": 1, "node status": 1}
        assert read_job_state(store, "nothing-here") == JobState(job="nothing-here")
    view = JobView(JobSources(job="typed", etcd_endpoint=etcd_server.endpoint, mirror=file_prefix(mirror),
                              etcd_store=backend))
    assert view.state().source == "etcd" and view.state().ranks == {"n1": 0, "n2": 1}
    assert sorted((e["ts"], e["node"]) for e in view.events()) == [(0.5, "n1"), (1, "i-a"), (1, "n1"),
                                                                  (2, "i-b"), (3, "i-a")]  # both copies, once


def test_a_silent_etcd_falls_back_to_the_mirror_and_says_so(mirror: Path) -> None:
    view = JobView(JobSources(job="demo", etcd_endpoint=UNREACHABLE, mirror=file_prefix(mirror)))
    state = view.state()
    assert state.source == "mirror" and state.ranks == {"i-a": 0, "i-b": 1}
    assert any(UNREACHABLE in note for note in view.notes())
    assert [e["ts"] for e in view.events()] == [1, 2, 3]
    assert view.result() is None  # still running: neither copy has a result
    write(mirror, "result.json", JobResult(state="failed", reason="max_restarts", ts=9.0).to_json())
    assert view.result() == JobResult(state="failed", reason="max_restarts", ts=9.0)
    with pytest.raises(ProviderError, match=f"cannot read job 'demo' from etcd at {UNREACHABLE}"):
        JobView(JobSources(job="demo", etcd_endpoint=UNREACHABLE)).state()
