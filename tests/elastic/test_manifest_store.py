"""Checkpoint stores and the manifest layer, against a directory and moto's S3 served over loopback HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from petctl.elastic import CheckpointStore, FileStore, ObjectNotFound, S3Options, S3Store, open_object_store
from petctl.elastic import manifest as mf


@pytest.fixture
def store(checkpoint_url: str) -> CheckpointStore:
    return open_object_store(checkpoint_url)


def test_open_store_picks_backend(tmp_path: Path, s3_url: str) -> None:
    assert isinstance(open_object_store(tmp_path.as_uri()), FileStore)
    assert isinstance(open_object_store(str(tmp_path)), FileStore)
    assert isinstance(open_object_store(s3_url), S3Store)
    with pytest.raises(ValueError):
        open_object_store("gs://bucket/x")


def test_put_get_list_delete(store: CheckpointStore, tmp_path: Path) -> None:
    src = tmp_path / "blob"
    src.write_bytes(b"x" * 1000)
    store.put_file("step-000000000001/state.pt", src)
    store.put_bytes("manifest-000000000001.json", b"{}")
    assert [(o.key, o.size) for o in store.list()] == [
        ("manifest-000000000001.json", 2), ("step-000000000001/state.pt", 1000)]
    assert [o.key for o in store.list("manifest-")] == ["manifest-000000000001.json"]
    assert store.get_bytes("manifest-000000000001.json") == b"{}"
    out = tmp_path / "out"
    store.get_file("step-000000000001/state.pt", out)
    assert out.read_bytes() == b"x" * 1000
    store.delete(["step-000000000001/state.pt", "manifest-000000000001.json", "never-existed"])
    assert store.list() == []
    with pytest.raises(ObjectNotFound):
        store.get_bytes("manifest-000000000001.json")
    with pytest.raises(ObjectNotFound):
        store.get_file("step-000000000001/state.pt", out)


def test_file_store_hides_in_flight_temporaries(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    (tmp_path / ".state.pt.abc.part").write_bytes(b"partial")
    assert store.list() == []
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"")


def test_multipart_upload_with_small_threshold(s3_url: str, tmp_path: Path, moto_endpoint: str) -> None:
    """A 12 MiB object with a 5 MiB threshold goes up in 3 parts (the multipart ETag says so)."""
    import boto3

    store = S3Store(s3_url, S3Options(multipart_threshold=5 << 20, multipart_chunksize=5 << 20))
    src = tmp_path / "big"
    src.write_bytes(bytes(range(256)) * (12 * 4096))
    store.put_file("step-000000000007/state.pt", src)
    head = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").head_object(
        Bucket=store.bucket, Key=f"{store.prefix}/step-000000000007/state.pt")
    assert head["ETag"].strip('"').endswith("-3")
    out = tmp_path / "back"
    store.get_file("step-000000000007/state.pt", out)
    assert mf.sha256_file(out) == mf.sha256_file(src)


def _write(store: CheckpointStore, tmp_path: Path, step: int, payload: bytes = b"data") -> mf.Manifest:
    src = tmp_path / f"src-{step}"
    src.write_bytes(payload + str(step).encode())
    return mf.write_checkpoint(store, step, {"state.pt": src})


def test_manifest_round_trip_and_order(store: CheckpointStore, tmp_path: Path) -> None:
    for step in (5, 120, 40):
        _write(store, tmp_path, step)
    assert mf.manifest_steps(store) == [120, 40, 5]
    m = mf.read_manifest(store, 40)
    assert m.step == 40 and m.objects[0].name == "state.pt" and m.objects[0].size == len(b"data40")
    assert mf.Manifest.from_json(m.to_json()) == m


def test_data_without_manifest_is_invisible(store: CheckpointStore, tmp_path: Path) -> None:
    """A writer killed after its data PUT but before its manifest PUT leaves nothing readers trust."""
    _write(store, tmp_path, 10)
    src = tmp_path / "orphan"
    src.write_bytes(b"half")
    store.put_file(mf.data_prefix(20) + "state.pt", src)
    assert mf.manifest_steps(store) == [10]


def test_corrupt_manifest_is_rejected(store: CheckpointStore, tmp_path: Path) -> None:
    store.put_bytes(mf.manifest_key(3), b"{not json")
    store.put_bytes(mf.manifest_key(4), json.dumps({"format": 99}).encode())
    for step in (3, 4):
        with pytest.raises(ValueError):
            mf.read_manifest(store, step)


def test_prune_keeps_newest_k_and_deletes_manifest_and_data(store: CheckpointStore, tmp_path: Path) -> None:
    for step in range(1, 7):
        _write(store, tmp_path, step * 10)
    orphan = tmp_path / "orphan"
    orphan.write_bytes(b"o")
    store.put_file(mf.data_prefix(15) + "state.pt", orphan)  # cut-off save older than the kept ones
    store.put_file(mf.data_prefix(70) + "state.pt", orphan)  # maybe still uploading: left alone
    deleted = mf.prune(store, keep=3)
    assert deleted == [10, 15, 20, 30]
    assert mf.manifest_steps(store) == [60, 50, 40]
    keys = {o.key for o in store.list()}
    assert keys == {mf.manifest_key(s) for s in (40, 50, 60)} | {
        mf.data_prefix(s) + "state.pt" for s in (40, 50, 60, 70)}


def test_verify_file_catches_truncation_and_bit_flips(tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"0123456789")
    (entry,) = mf.describe_files({"f": src})
    assert mf.verify_file(src, entry)
    src.write_bytes(b"01234")
    assert not mf.verify_file(src, entry)
    src.write_bytes(b"0123456788")
    assert not mf.verify_file(src, entry)
    assert not mf.verify_file(tmp_path / "missing", entry)
