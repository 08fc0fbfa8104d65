"""Worker-side fencing: while `<control>/fenced` exists no checkpoint becomes loadable, whether the save
began under the fence or before it (a background upload still in flight when the agent fenced the node);
once the file is gone saves commit again. The one-writer checkpointer runs against a directory and moto's
S3; the sharded one in a single process."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch

from petctl.elastic import Checkpointer, open_object_store
from petctl.elastic import manifest as mf
from petctl.io import controlfiles
from tests.support.checkpointing import CountingStore, Recorder, assert_same, make_state, train


@pytest.fixture
def url(checkpoint_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PETCTL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PETCTL_CONTROL_DIR", raising=False)
    return checkpoint_url


def data_steps(url: str) -> set[int]:
    """Steps with any data object in the store (committed or not)."""
    return {int(m.group(1)) for o in open_object_store(url).list() if (m := mf.DATA_RE.match(o.key))}


def newest_loadable(url: str, tmp_path: Path) -> tuple[int, object]:
    """What a fresh node resumes from: (next step, the loaded state)."""
    fresh = make_state(seed=7)
    with Checkpointer(url, use_cache=False, control_dir=tmp_path / "other-node") as ckpt:
        return ckpt.resume(fresh), fresh


def test_a_fenced_save_commits_nothing_and_saves_commit_again_once_lifted(url: str, tmp_path: Path) -> None:
    control = tmp_path / "control"
    rec = Recorder()
    state = make_state()
    with Checkpointer(url, keep=10, background=False, control_dir=control, log=rec.log) as ckpt:
        train(state, 2)
        assert ckpt.save(1, state, block=True) is not None
        committed = make_state(seed=3)
        committed.load_state_dict(copy.deepcopy(state.state_dict()))  # what step 1 holds

        controlfiles.write_fence(control, round_no=4, reason="etcd unreachable, workers stalled")
        for step in (2, 3):
            train(state, 1)
            assert ckpt.save(step, state, block=True) is None
        assert mf.manifest_steps(open_object_store(url)) == [1]
        assert data_steps(url) == {1}  # a fenced node uploads nothing at all
        start, loaded = newest_loadable(url, tmp_path)
        assert start == 2
        assert_same(committed, loaded)  # the previous checkpoint stays the newest loadable one

        controlfiles.clear(control)
        train(state, 1)
        assert ckpt.save(4, state, block=True) is not None
        assert ckpt.fence.skipped == 2
    assert mf.manifest_steps(open_object_store(url)) == [4, 1]
    start, loaded = newest_loadable(url, tmp_path)
    assert start == 5
    assert_same(state, loaded)
    (fenced,) = rec.events("checkpoint.fenced")  # once per fence, not once per skipped save
    assert fenced["step"] == 2 and fenced["stage"] == "upload" and fenced["fence_round"] == 4
    assert fenced["reason"] == "etcd unreachable, workers stalled"
    (unfenced,) = rec.events("checkpoint.unfenced")
    assert unfenced["step"] == 4 and unfenced["skipped"] == 2
    assert [e["step"] for e in rec.events("checkpoint.saved")] == [1, 4]
    assert rec.events("checkpoint.save_failed") == []  # a fence is not a failure


def test_a_background_save_begun_before_the_fence_does_not_commit(url: str, tmp_path: Path) -> None:
    """The upload was in flight when the agent fenced the node: its manifest must never appear."""
    control = tmp_path / "control"
    rec = Recorder()
    hold = threading.Event()
    store = CountingStore(open_object_store(url), hold=hold)
    state = make_state()
    with Checkpointer(url, keep=10, control_dir=control, store=store, log=rec.log) as ckpt:
        hold.set()
        assert ckpt.save(0, state, block=True) is not None
        hold.clear()
        store.uploading.clear()
        train(state, 1)
        assert ckpt.save(1, state) is None  # background: returns at once, upload held
        assert store.uploading.wait(30)
        controlfiles.write_fence(control, round_no=2, reason="cut off")
        hold.set()
        ckpt.wait()  # the upload finished; the commit did not happen
        assert ckpt.fence.skipped == 1
        assert ckpt.last_saved is not None and ckpt.last_saved.step == 0
    assert mf.manifest_steps(open_object_store(url)) == [0]
    assert newest_loadable(url, tmp_path)[0] == 1
    (fenced,) = rec.events("checkpoint.fenced")
    assert fenced["step"] == 1 and fenced["stage"] == "commit"


def test_a_save_now_save_under_a_fence_is_reported_failed_not_saved(url: str, tmp_path: Path) -> None:
    control = tmp_path / "control"
    rec = Recorder()
    with Checkpointer(url, control_dir=control, log=rec.log) as ckpt:
        controlfiles.write_fence(control, round_no=1, reason="cut off")
        controlfiles.write_save_now(control, "n1", deadline=1e12)
        assert ckpt.step_end(3, make_state()) is True
    assert mf.manifest_steps(open_object_store(url)) == []
    assert controlfiles.read_saved(control) == {}  # the agent is not told a save exists
    assert [e["step"] for e in rec.events("save_now.save_failed")] == [3]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_saves_obey_the_fence(tmp_path: Path) -> None:
    from petctl.elastic.sharded import ShardedCheckpointer

    url = (tmp_path / "ckpt").as_uri()
    control = tmp_path / "control"
    app = {"w": torch.arange(4.0)}
    with ShardedCheckpointer(url, keep=10, background=False, local_dir=tmp_path / "dcp",
                             control_dir=control) as ckpt:
        assert ckpt.save(0, app, block=True) is True
        controlfiles.write_fence(control, round_no=3, reason="cut off")
        app["w"] += 1
        assert ckpt.save(1, app, block=True) is False
        assert mf.manifest_steps(open_object_store(url)) == [0] and data_steps(url) == {0}
        controlfiles.clear(control)
        app["w"] += 1
        assert ckpt.save(2, app, block=True) is True
        assert ckpt.fence.skipped == 1
    assert mf.manifest_steps(open_object_store(url)) == [2, 0]
    restored = {"w": torch.zeros(4)}
    with ShardedCheckpointer(url, local_dir=tmp_path / "dcp2", control_dir=tmp_path / "c2") as ckpt:
        assert ckpt.resume(restored) == 3
    assert torch.equal(restored["w"], torch.arange(4.0) + 2)


def test_sharded_background_upload_fenced_before_its_manifest(tmp_path: Path) -> None:
    """Rank 0's manifest is the commit: a fence that appears while its shards upload stops it."""
    from petctl.elastic.sharded import ShardedCheckpointer

    url = (tmp_path / "ckpt").as_uri()
    control = tmp_path / "control"
    hold = threading.Event()
    store = CountingStore(open_object_store(url), hold=hold)
    with ShardedCheckpointer(url, keep=10, local_dir=tmp_path / "dcp", control_dir=control,
                             store=store) as ckpt:
        assert ckpt.save(5, {"w": torch.ones(3)}) is True  # background
        assert store.uploading.wait(30)
        controlfiles.write_fence(control, round_no=1, reason="cut off")
        hold.set()
        ckpt.wait()
        assert ckpt.fence.skipped == 1
    assert mf.manifest_steps(open_object_store(url)) == []
    assert data_steps(url) == {5}  # the shards went up before the fence; unnamed, they are never loaded
