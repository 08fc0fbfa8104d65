"""petctl.elastic's collectives leave nothing for gloo's worker thread to release at interpreter exit.

The failure this guards against (seen in the slow tier under load, confirmed in core dumps): a worker that
had just made its save-now save aborted at exit with `terminate called without an active exception`.
gloo's worker thread ("pt_gloo_runloop") destroyed a finished collective's work after the interpreter had
started finalizing; releasing its tensors' Python objects took the GIL, Python ended the thread, and the
forced unwind through a noexcept destructor called std::terminate. See petctl/elastic/dist.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from petctl.elastic.dist import GLOO_THREAD_NAME, gloo_threads_runnable
from tests.support.helpers_gloo import WORKER_PRELUDE, run_worker_pair


def fake_task(root: Path, tid: int, name: str, state: str) -> None:
    task = root / str(tid)
    task.mkdir(parents=True)
    (task / "comm").write_text(name + "\n")
    (task / "stat").write_text(f"{tid} ({name}) {state} 1 2 3 4\n")


def test_runnable_gloo_threads_are_counted_from_their_task_state(tmp_path: Path) -> None:
    fake_task(tmp_path, 10, "python", "R")  # the main thread: not gloo's
    fake_task(tmp_path, 11, GLOO_THREAD_NAME, "S")  # waiting for work (or the GIL): idle
    fake_task(tmp_path, 12, GLOO_THREAD_NAME, "R")  # finishing a collective: busy
    fake_task(tmp_path, 13, GLOO_THREAD_NAME, "D")
    (tmp_path / "14").mkdir()  # a thread that exited while we looked
    assert gloo_threads_runnable(tmp_path) == 2
    assert gloo_threads_runnable(tmp_path / "missing") == 0


WORKER = WORKER_PRELUDE + r'''
from petctl.elastic import dist as pdist

comm = pdist.Comm.create()
big = bytes(range(256)) * 12000  # ~3 MB, more than one gloo buffer
got_big = comm.broadcast_object({"step": 7, "blob": big} if rank == 0 else None)
got_none = comm.broadcast_object(None)
flags = [comm.any_true(rank == 1), comm.any_true(False)]
# What _settle waits for: once gloo has destroyed the work, Python holds the only reference to a tensor.
t = torch.ones(4)
work = dist.all_reduce(t, async_op=True)
work.wait()
del work
settled = pdist._settle((t,))
out.write_text(json.dumps({"big_ok": got_big == {"step": 7, "blob": big}, "none": got_none, "flags": flags,
                           "settled": settled, "use_count": t._use_count(),
                           "quiesced": pdist.quiesce_gloo_threads()}))
dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_collectives_round_trip_and_release_their_tensors_before_returning(tmp_path: Path) -> None:
    ranks = run_worker_pair(tmp_path, WORKER, "run", (tmp_path / "unused").as_uri(), tag="dist",
                            timeout=150, rank_env=lambda rank: {})
    for r in ranks:
        assert r["big_ok"] and r["none"] is None
        assert r["flags"] == [True, False]  # MAX over ranks: rank 1's True reaches rank 0
        assert r["settled"] and r["use_count"] == 1
        assert r["quiesced"]  # no gloo thread left runnable: the atexit hook would return at once
