"""A node's prefetch of the newest checkpoint into its cache, before it registers (issue 14, item 2).

`petctl.elastic.prefetch` (the child the agent runs) and `petctl.agent.workers.Prefetch` (the agent's
side: spawn, bound, pass the event on). Real files in a file:// store; no torch.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from petctl.agent.workers import Prefetch
from petctl.elastic import FileStore
from petctl.elastic import manifest as mf
from petctl.elastic.manifest import LocalCache
from petctl.elastic.prefetch import prefetch
from petctl.io.eventlog import EventLog


def _checkpoint(store: FileStore, tmp: Path, step: int, payload: bytes) -> None:
    src = tmp / f"src-{step}"
    src.mkdir()
    (src / "state.pt").write_bytes(payload)
    mf.write_checkpoint(store, step, {"state.pt": src / "state.pt"})


def _log() -> tuple[EventLog, list[dict]]:
    seen: list[dict] = []
    log = EventLog("test", stream=io.StringIO())
    log.add_sink(seen.append)
    return log, seen


def test_the_newest_checkpoint_lands_in_the_cache_where_a_resume_finds_it(tmp_path):
    store = FileStore(tmp_path / "ckpt")
    _checkpoint(store, tmp_path, 9, b"old" * 100)
    _checkpoint(store, tmp_path, 19, b"new" * 100)
    cache = LocalCache(store.url, tmp_path / "cache")
    log, seen = _log()
    assert prefetch(store, cache, log) == 19
    newest = mf.read_manifest(store, 19)
    assert cache.lookup(newest) is not None  # what Checkpointer.resume looks up first
    assert (cache.committed(19) / "state.pt").read_bytes() == b"new" * 100
    assert [(e["event"], e["step"], e["source"]) for e in seen] == [("checkpoint.prefetched", 19, "store")]
    # A second prefetch (a restarted agent) finds it cached and downloads nothing.
    log, seen = _log()
    assert prefetch(store, cache, log) == 19 and seen[0]["source"] == "cache"


def test_a_corrupt_newest_checkpoint_is_skipped_as_a_resume_would(tmp_path):
    store = FileStore(tmp_path / "ckpt")
    _checkpoint(store, tmp_path, 9, b"good" * 10)
    _checkpoint(store, tmp_path, 19, b"torn" * 10)
    newest = mf.read_manifest(store, 19)
    (tmp_path / "ckpt" / newest.key_of(newest.objects[0])).write_bytes(b"bad")
    cache = LocalCache(store.url, tmp_path / "cache")
    log, seen = _log()
    assert prefetch(store, cache, log) == 9
    assert [e["event"] for e in seen] == ["checkpoint.skipped_corrupt", "checkpoint.prefetched"]
    assert not list(cache.dir.glob("staging-*"))  # the torn download was discarded


def test_an_empty_store_prefetches_nothing(tmp_path):
    store = FileStore(tmp_path / "ckpt")
    log, seen = _log()
    assert prefetch(store, LocalCache(store.url, tmp_path / "cache"), log) is None
    assert seen[0]["event"] == "checkpoint.prefetched" and seen[0]["step"] is None


def test_the_agent_runs_it_as_a_child_and_passes_its_event_on(tmp_path):
    store = FileStore(tmp_path / "ckpt")
    _checkpoint(store, tmp_path, 4, b"x" * 1000)
    out = io.StringIO()
    log, seen = _log()
    job = Prefetch(store.url, tmp_path / "cache", dict(os.environ), log, out)
    job.start()
    assert job.finish(60) == 4
    assert [e["event"] for e in seen] == ["checkpoint.prefetched"]  # forwarded to the sinks (etcd, mirror)
    assert json.loads(out.getvalue().splitlines()[-1])["step"] == 4  # and on the node log


def test_an_unreadable_store_is_one_line_and_no_step(tmp_path):
    run = subprocess.run([sys.executable, "-m", "petctl.elastic.prefetch", "--url", "ftp://nowhere/x",
                          "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr
    (line,) = run.stdout.splitlines()
    assert json.loads(line)["event"] == "checkpoint.prefetch_failed"
    out = io.StringIO()
    log, seen = _log()
    job = Prefetch("ftp://nowhere/x", tmp_path / "cache", dict(os.environ), log, out)
    job.start()
    assert job.finish(60) is None and seen[0]["event"] == "checkpoint.prefetch_failed"
