"""The test workloads' slow store, as tests/e2e/test_notice_during_upload.py relies on it: the first upload
stays in flight, part written, until the test says when it ends; later uploads take their fixed time; and
ending the padding releases a held upload at once."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.workloads.ledger_train import Ledger, throttled_store
from tests.workloads.padding import UNPADDED


def _events(directory: Path) -> list[dict]:
    return [json.loads(line) for f in directory.glob("*.jsonl") for line in f.read_text().splitlines()]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ledger_dir = tmp_path / "ledger"
    monkeypatch.setenv("LEDGER_DIR", str(ledger_dir))
    held = ledger_dir / "upload_ends"
    obj = tmp_path / "state.bin"
    obj.write_bytes(bytes(range(256)) * 40)
    return throttled_store((tmp_path / "ckpt").as_uri(), 0.2, Ledger(ledger_dir, 0, 1), held), held, obj


def test_the_first_upload_is_held_until_the_time_the_test_writes(store, tmp_path: Path):
    throttled, held, obj = store
    upload = threading.Thread(target=throttled.put_file, args=("step-00000049/state.bin", obj))
    upload.start()
    time.sleep(0.5)  # far longer than an unheld upload (0.2 s)
    target = tmp_path / "ckpt" / "step-00000049" / "state.bin"
    assert upload.is_alive() and 0 < target.stat().st_size < obj.stat().st_size  # in flight, torn so far
    ends = time.time() + 0.3
    held.write_text(repr(ends))
    upload.join(timeout=5)
    assert not upload.is_alive() and target.read_bytes() == obj.read_bytes()
    (done,) = [e for e in _events(tmp_path / "ledger") if e["event"] == "upload_done"]
    assert done["step"] == 49 and done["ts"] >= ends

    started = time.time()
    throttled.put_file("step-00000099/state.bin", obj)  # the next one is not held: its fixed time
    assert 0.15 <= time.time() - started < 2.0


def test_ending_the_padding_releases_a_held_upload(store, tmp_path: Path):
    throttled, _, obj = store
    upload = threading.Thread(target=throttled.put_file, args=("step-00000049/state.bin", obj))
    upload.start()
    time.sleep(0.3)
    assert upload.is_alive()
    (tmp_path / "ledger" / UNPADDED).touch()
    upload.join(timeout=5)
    assert not upload.is_alive()
