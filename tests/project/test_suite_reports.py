"""The suite's own plumbing: a test report or warning carrying a lone surrogate reaches the xdist
controller (tests/support/xdist_reports.py), where without it the whole run stops with an internal error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.xdist_reports import encodable

TESTS = '''
import logging
import warnings

def test_a_passing_test_whose_captured_log_holds_a_surrogate():
    logging.getLogger("third.party").warning("read %s", b"bad \\xff byte".decode("utf-8", "surrogateescape"))

def test_a_failure_whose_message_holds_a_surrogate():
    assert False, "bad \\udcff byte"

def test_a_warning_that_holds_a_surrogate():
    warnings.warn(UserWarning("odd \\udcfe name"))

def test_the_run_goes_on():
    pass
'''


def _run(tmp_path: Path, *plugin: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_surrogates.py").write_text(TESTS)
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", *plugin,
                           "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_a_report_holding_a_surrogate_reaches_the_controller(tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    assert request.config.pluginmanager.has_plugin("tests.support.xdist_reports")  # this suite runs with it
    bare = _run(tmp_path)  # what xdist does alone: the worker's send fails, the run stops
    assert bare.returncode == 3, bare.stdout[-3000:]
    assert "INTERNALERROR" in bare.stdout and "strings must be utf-8 encodable" in bare.stdout

    run = _run(tmp_path, "-p", "tests.support.xdist_reports")
    assert run.returncode == 1, run.stdout[-3000:]
    assert "INTERNALERROR" not in run.stdout + run.stderr
    assert "1 failed, 3 passed, 1 warning" in run.stdout
    assert "bad \\udcff byte" in run.stdout  # the text is kept, its surrogate written as an escape
    assert "UserWarning: odd \\udcfe name" in run.stdout


def test_encodable_escapes_surrogates_at_any_depth_and_keeps_the_rest() -> None:
    data = {"sections": [("Captured log call", "a \udcff b")], "n": 3, "ok": "plain é", "none": None,
            "k\udc80": ["x", ("\udcff",)]}
    assert encodable(data) == {"sections": [("Captured log call", "a \\udcff b")], "n": 3, "ok": "plain é",
                               "none": None, "k\\udc80": ["x", ("\\udcff",)]}
    assert encodable("plain") == "plain"
