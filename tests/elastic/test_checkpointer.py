"""Checkpointer in one process: round trips, torn and corrupt saves, retention, background saves, cache,
and the save-now path. Every test runs against a directory (file://) and moto's S3 over loopback HTTP."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from petctl.elastic import Checkpointer, open_object_store
from petctl.elastic import manifest as mf
from petctl.elastic.state import load_payload
from petctl.io import controlfiles
from tests.support.checkpointing import CountingStore, Recorder, assert_same, make_state, train


@pytest.fixture
def url(checkpoint_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A checkpoint URL on each backend, with this test's own cache and no agent's control dir."""
    monkeypatch.setenv("PETCTL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PETCTL_CONTROL_DIR", raising=False)
    return checkpoint_url


def test_fresh_start_returns_zero(url: str) -> None:
    with Checkpointer(url) as ckpt:
        assert ckpt.resume(make_state()) == 0


def test_round_trip_model_optimizer_scheduler_extra(url: str, tmp_path: Path) -> None:
    rec = Recorder()
    state = make_state()
    train(state, 3)
    state.extra.update(step=9, epoch=2, sampler={"offset": 123})
    with Checkpointer(url, log=rec.log) as ckpt:
        manifest = ckpt.save(9, state, block=True)
    assert manifest is not None and manifest.step == 9
    (saved,) = rec.events("checkpoint.saved")
    assert saved["step"] == 9 and saved["bytes"] == manifest.total_bytes > 0 and saved["url"] == url

    fresh = make_state(seed=1)
    extra = fresh.extra
    with Checkpointer(url, cache_dir=tmp_path / "other-node", log=rec.log) as ckpt:
        assert ckpt.resume(fresh) == 10
    assert_same(state, fresh)
    assert fresh.extra is extra  # restored in place
    (loaded,) = rec.events("checkpoint.loaded")
    assert loaded["step"] == 9 and loaded["source"] == "store"


def test_snapshot_is_taken_at_save_time(url: str) -> None:
    state = make_state()
    with Checkpointer(url) as ckpt:
        ckpt.save(0, state)  # background
        expected = {k: v.clone() for k, v in state.model.state_dict().items()}
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(1.0)  # training moves on while the upload runs
    fresh = make_state(seed=5)
    with Checkpointer(url, use_cache=False) as ckpt:
        ckpt.resume(fresh)
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, expected[k])


def test_next_save_reuses_buffers_and_both_checkpoints_stay_right(url: str, tmp_path: Path) -> None:
    state = make_state()
    with Checkpointer(url, keep=5) as ckpt:
        ckpt.save(0, state, block=True)
        first = ckpt._staged
        at_step0 = {k: v.clone() for k, v in state.model.state_dict().items()}
        with torch.no_grad():
            for p in state.model.parameters():
                p.mul_(-2.0)
        ckpt.save(1, state, block=True)
        second = ckpt._staged
        at_step1 = {k: v.clone() for k, v in state.model.state_dict().items()}
    # The upload of step 0 was done: step 1 was copied into its buffers, not into fresh memory.
    assert all(second["model"][k].data_ptr() == first["model"][k].data_ptr() for k in at_step0)
    # ...and that did not touch what step 0 had written.
    store = open_object_store(url)
    for step, expected in ((0, at_step0), (1, at_step1)):
        path = tmp_path / f"state-{step}.pt"
        store.get_file(mf.data_prefix(step) + "state.pt", path)
        _step, snap = load_payload(path)
        assert _step == step
        assert all(torch.equal(snap["model"][k], v) for k, v in expected.items())


def test_a_save_during_an_upload_takes_fresh_buffers(url: str) -> None:
    state = make_state()
    release = threading.Event()
    with Checkpointer(url) as ckpt:
        ckpt.save(0, state, block=True)
        first = ckpt._staged
        ckpt._uploader.submit(lambda: release.wait(10))  # an upload still in flight
        threading.Timer(0.3, release.set).start()
        ckpt.save(1, state)
        second = ckpt._staged
    assert all(second["model"][k].data_ptr() != first["model"][k].data_ptr() for k in first["model"])


def test_reuse_buffers_off_keeps_no_copy(url: str) -> None:
    with Checkpointer(url, reuse_buffers=False) as ckpt:
        ckpt.save(0, make_state(), block=True)
        assert ckpt._staged is None


def test_data_without_manifest_resumes_previous(url: str, tmp_path: Path) -> None:
    """A kill between the data upload and the manifest: the previous checkpoint is the newest complete."""
    state = make_state()
    with Checkpointer(url) as ckpt:
        ckpt.save(9, state, block=True)
    store = open_object_store(url)
    partial = tmp_path / "partial"
    partial.write_bytes(b"\x00" * 100)
    store.put_file(mf.data_prefix(19) + "state.pt", partial)
    with Checkpointer(url, use_cache=False) as ckpt:
        assert ckpt.resume(make_state(seed=3)) == 10


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "bad-hash", "bad-manifest", "missing-data"])
def test_corrupt_newest_is_never_loaded(url: str, tmp_path: Path, damage: str) -> None:
    rec = Recorder()
    state = make_state()
    with Checkpointer(url, keep=5) as ckpt:
        ckpt.save(9, state, block=True)
        expected = make_state(seed=7)
        with Checkpointer(url, use_cache=False) as reader:
            reader.resume(expected)
        train(state, 1)
        ckpt.save(19, state, block=True)
    store = open_object_store(url)
    key = mf.data_prefix(19) + "state.pt"
    good = store.get_bytes(key)
    if damage == "truncate":
        store.put_bytes(key, good[: len(good) // 2])
    elif damage == "bitflip":
        store.put_bytes(key, good[:-1] + bytes([good[-1] ^ 0xFF]))
    elif damage == "bad-hash":
        m = mf.read_manifest(store, 19)
        m.objects[0] = mf.ObjectEntry(m.objects[0].name, m.objects[0].size, "0" * 64)
        store.put_bytes(mf.manifest_key(19), m.to_json().encode())
    elif damage == "bad-manifest":
        store.put_bytes(mf.manifest_key(19), b'{"format": 1, "step": 19')
    else:
        store.delete([key])
    fresh = make_state(seed=3)
    with Checkpointer(url, cache_dir=tmp_path / "elsewhere", log=rec.log) as ckpt:
        assert ckpt.resume(fresh) == 10
    assert_same(expected, fresh)
    (skipped,) = rec.events("checkpoint.skipped_corrupt")
    assert skipped["step"] == 19
    assert [e["step"] for e in rec.events("checkpoint.loaded")] == [9]


def test_retention_keeps_exactly_k(url: str) -> None:
    state = make_state()
    with Checkpointer(url, keep=3, every=1, background=False) as ckpt:
        for step in range(7):
            assert ckpt.step_end(step, state) is False
    store = open_object_store(url)
    assert mf.manifest_steps(store) == [6, 5, 4]
    data_steps = {int(o.key[5:17]) for o in store.list("step-")}
    assert data_steps == {4, 5, 6}


def test_periodic_schedule(url: str) -> None:
    state = make_state()
    with Checkpointer(url, keep=10, every=4) as ckpt:
        for step in range(10):
            ckpt.step_end(step, state)
    assert mf.manifest_steps(open_object_store(url)) == [7, 3]


def test_background_save_overlaps_training_and_next_save_waits(url: str) -> None:
    hold = threading.Event()
    store = CountingStore(open_object_store(url), hold=hold)
    state = make_state()
    ckpt = Checkpointer(url, every=1, store=store)
    try:
        assert ckpt.step_end(0, state) is False  # returns while the upload is held
        assert store.uploading.wait(10)
        assert ckpt._uploader.busy and mf.manifest_steps(store) == []

        second = threading.Thread(target=ckpt.step_end, args=(1, state))
        second.start()
        second.join(0.5)
        assert second.is_alive(), "the second save must wait for the first upload"
        hold.set()
        second.join(30)
        assert not second.is_alive()
        ckpt.wait()
        assert mf.manifest_steps(store) == [1, 0]
        assert ckpt._uploader.waits == 1
    finally:
        hold.set()
        ckpt.close()


def test_restart_on_same_node_uses_cache(url: str, tmp_path: Path) -> None:
    rec = Recorder()
    state = make_state()
    with Checkpointer(url, cache_dir=tmp_path / "node") as ckpt:
        ckpt.save(4, state, block=True)
    store = CountingStore(open_object_store(url))
    with Checkpointer(url, cache_dir=tmp_path / "node", store=store, log=rec.log) as ckpt:
        assert ckpt.resume(make_state(seed=2)) == 5
    assert store.reads == 1  # the manifest only: the data came from the local cache
    assert rec.events("checkpoint.loaded")[-1]["source"] == "cache"

    # A damaged cache entry is never trusted: the store is read again.
    (cached,) = (tmp_path / "node").glob("*/step-*/state.pt")
    cached.write_bytes(b"garbage")
    fresh = make_state(seed=2)
    with Checkpointer(url, cache_dir=tmp_path / "node", log=rec.log) as ckpt:
        assert ckpt.resume(fresh) == 5
    assert rec.events("checkpoint.loaded")[-1]["source"] == "store"
    assert_same(state, fresh)


def test_save_now_flag_saves_synchronously_and_reports(url: str, tmp_path: Path) -> None:
    control = tmp_path / "control"
    state = make_state()
    with Checkpointer(url, every=100, control_dir=control) as ckpt:
        for step in range(3):
            assert ckpt.step_end(step, state) is False
        controlfiles.write_save_now(control, "i-local-1", deadline=1e10)
        assert ckpt.step_end(3, state) is True
        # synchronous: the manifest exists before step_end returned
        assert mf.manifest_steps(open_object_store(url)) == [3]
        assert controlfiles.read_saved(control) == {0: 3}
        assert ckpt.step_end(4, state) is True  # sticky
    with Checkpointer(url, use_cache=False) as ckpt:
        assert ckpt.resume(make_state(seed=9)) == 4


def test_check_interval(url: str, tmp_path: Path) -> None:
    control = tmp_path / "control"
    controlfiles.write_save_now(control, "n", deadline=0)
    with Checkpointer(url, control_dir=control, check_every=2) as ckpt:
        assert ckpt.should_checkpoint(3) is False
        assert ckpt.should_checkpoint(4) is True


class FailingStore(CountingStore):
    def put_file(self, key: str, path: Path) -> None:
        raise OSError("network down")


def test_failed_save_is_logged_not_raised(url: str, tmp_path: Path) -> None:
    rec = Recorder()
    control = tmp_path / "control"
    state = make_state()
    with Checkpointer(url, every=1, store=FailingStore(open_object_store(url)), control_dir=control,
                      log=rec.log) as ckpt:
        assert ckpt.step_end(0, state) is False
        ckpt.wait()
        assert rec.events("checkpoint.save_failed")
        controlfiles.write_save_now(control, "n", deadline=0)
        assert ckpt.step_end(1, state) is True  # the node goes away regardless...
    assert controlfiles.read_saved(control) == {}  # ...but never claims a save it did not make
    assert rec.events("save_now.save_failed")


class Opaque:
    """A user object in `extra` that torch's safe unpickler refuses."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_extras_beyond_weights_only_need_opt_in(url: str) -> None:
    state = make_state()
    state.extra["sampler"] = Opaque(7)
    with Checkpointer(url) as ckpt:
        ckpt.save(2, state, block=True)
    with Checkpointer(url, use_cache=False) as ckpt, pytest.raises(ValueError, match="weights_only=False"):
        ckpt.resume(make_state())  # a clear error, not a silent fall back to an older checkpoint
    fresh = make_state()
    with Checkpointer(url, use_cache=False, weights_only=False) as ckpt:
        assert ckpt.resume(fresh) == 3
    assert fresh.extra["sampler"].value == 7


def test_cache_sweeps_staging_of_dead_processes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from petctl.elastic.manifest import LocalCache

    cache = LocalCache("file:///x", tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = cache.dir / f"staging-000000000005-{dead}"
    stale.mkdir(parents=True)
    mine = cache.staging(6)
    assert cache.sweep() == [stale]
    assert mine.is_dir() and not stale.exists()


def test_time_based_periodic_save(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from petctl.elastic import checkpointer as module

    now = [1000.0]
    monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    state = make_state()
    with Checkpointer(url, keep=10, every=0, every_seconds=60, background=False) as ckpt:
        now[0] += 59
        assert ckpt.step_end(0, state) is False
        assert mf.manifest_steps(open_object_store(url)) == []  # not due yet
        now[0] += 1
        ckpt.step_end(1, state)
        now[0] += 59
        ckpt.step_end(2, state)  # the clock restarted at the save of step 1
    assert mf.manifest_steps(open_object_store(url)) == [1]


class NoDeleteStore(CountingStore):
    def delete(self, keys: list[str]) -> None:
        raise OSError("AccessDenied")


def test_failed_prune_does_not_fail_a_complete_save(url: str, tmp_path: Path) -> None:
    rec = Recorder()
    control = tmp_path / "control"
    state = make_state()
    with Checkpointer(url, keep=1, store=NoDeleteStore(open_object_store(url)), control_dir=control,
                      log=rec.log) as ckpt:
        assert ckpt.save(0, state, block=True) is not None
        controlfiles.write_save_now(control, "n", deadline=0)
        assert ckpt.step_end(1, state) is True
    assert controlfiles.read_saved(control) == {0: 1}  # the save-now save counts as done
    assert rec.events("checkpoint.prune_failed") and not rec.events("checkpoint.save_failed")
