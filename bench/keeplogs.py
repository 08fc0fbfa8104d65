"""pytest plugin (`-p bench.keeplogs`): keep the local provider's logs in each test's tmp dir.

`petctl teardown` removes the job directories under PETCTL_HOME, node logs included. To count drops after
a run (bench/drops.py), or to read why a slow test failed, every log of every job is copied to
`<tmp>/kept/<job>/...` just before the teardown runs: the nodes' (`instances/<id>/*.log`), the
reconciler's, and the job's records (`instances.json`, `notices/*.json`). Measurement only: the tests
themselves are unchanged.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def pytest_collection_finish(session: Any) -> None:
    conftest = sys.modules.get("tests.conftest")
    if conftest is None or getattr(conftest.petctl_in, "keeps_logs", False):
        return
    original = conftest.petctl_in

    @contextlib.contextmanager
    def keeping(root: Path) -> Iterator[Any]:
        with original(root) as cli:
            try:
                yield cli
            finally:
                jobs = cli.home / "local" / "jobs"
                kept = [*jobs.glob("*/**/*.log"), *jobs.glob("*/*.json"), *jobs.glob("*/notices/*.json")]
                for log in kept:
                    dest = root / "kept" / log.relative_to(jobs)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with contextlib.suppress(OSError):  # a log being rotated away: the others still count
                        shutil.copy(log, dest)

    keeping.keeps_logs = True  # type: ignore[attr-defined]
    conftest.petctl_in = keeping
