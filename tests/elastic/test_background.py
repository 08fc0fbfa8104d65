"""The background uploader: one job at a time, errors reported not raised, and it yields the CPU."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from petctl.elastic.background import BACKGROUND_NICE, BackgroundUploader


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_upload_thread_runs_at_lower_priority_than_training():
    training = _nice_of_this_thread()
    up = BackgroundUploader()
    try:
        upload = up.submit(_nice_of_this_thread).result(timeout=10)
    finally:
        up.close()
    assert upload == min(19, training + BACKGROUND_NICE)
    assert _nice_of_this_thread() == training  # the caller (the training loop) is left as it was


def test_a_save_waits_for_the_previous_upload_and_errors_go_to_the_callback():
    errors: list[BaseException] = []
    release = threading.Event()
    up = BackgroundUploader(on_error=errors.append)
    try:
        first = up.submit(lambda: release.wait(10) and "first")
        assert up.busy
        threading.Timer(0.2, release.set).start()
        second = up.submit(lambda: 1 / 0)  # blocks until `first` is done
        assert first.done() and first.result() == "first"
        assert up.waits == 1
        assert up.wait() is None  # the failed job's result: None, never an exception
    finally:
        up.close()
    assert second.done() and len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)
