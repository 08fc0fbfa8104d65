"""Fault matrix, issue 13 item 2: a spot notice arrives while a checkpoint upload is in flight, and the
preemption save that follows does not finish in time. No torn checkpoint is ever loaded: the job resumes
from the newest complete one, with the exact weights.

The upload is slow the way a congested link (or a big state) makes it slow: rank 0's store takes UPLOAD s
per state object (tests/workloads/ledger_train.py, `ThrottledStore`), and writes straight to the
object's key, so a save cut off leaves a truncated object behind with no manifest (harsher than S3,
where an object appears whole). The agent gives the preemption save all but a margin before the reclaim
(a quarter of a short notice: `save_budget`); the notice to rank 0 (the writer) gives GRACE s, so that
the save has UPLOAD + 1.5 s:

    the periodic save of step 49 starts uploading, and stays in flight (`UPLOAD_HELD`) until the test
       has delivered the notice: the CLI's start-up, seconds on a loaded machine, races nothing
    -> the notice lands (`petctl chaos --notice`) while that upload is in flight; the test then lets the
       upload end UPLOAD / 2 s after the notice, well inside the save's time
    -> no save was measured before the notice (the first one is still uploading), so nothing says the
       window is long enough: the noticed node hands off at once (agent/roundjudge.py, `handoff`)
    -> every rank sees the save-now flag at the same step j; rank 0's preemption save of j waits for
       the upload of 49 to finish, then uploads j (another UPLOAD s)
    -> UPLOAD + 1.5 s after the notice the agent's save deadline passes: it stops its workers (the
       upload of j is cut off: data, no manifest), leaves, and ends its instance before the reclaim
    -> the survivor re-forms alone and resumes from 49 (complete), not from j (torn)

That is a 2-minute AWS notice scaled down: 90 s for the save (`save_deadline`), a state that needs
more. The store is what this tests: in-memory snapshots are off (PETCTL_SNAPSHOTS=0; with them the
survivor would resume from its own snapshot of j and redo nothing). Real etcd,
agents and gloo workers on the local provider; the replacement is held back (`--replace-delay`) so the
survivor's round is the one that finishes the job.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from petctl.agent.notices import SHORT_NOTICE_SHARE, save_budget
from tests.support.cli import Petctl
from tests.support.ledger import Ledger, data_steps, manifests
from tests.support.matrix import run_ledger_job, wait_until
from tests.support.userledger import end_padding, slow_padding

pytestmark = pytest.mark.slow

STEPS, EVERY = 150, 50
UPLOAD = 6.0
# The save gets UPLOAD + 1.5 s: enough for the upload in flight to finish (it started before the notice;
# IMDS times have whole seconds, so the agent's deadline may come up to 1 s early), not for a second one.
# A notice this short keeps a quarter of its time as the margin (petctl/agent/notices.py save_budget).
GRACE = (UPLOAD + 1.5) / (1 - SHORT_NOTICE_SHARE)
assert save_budget(GRACE, save_deadline=90.0) == pytest.approx(UPLOAD + 1.5)


def uploads(ledger: Ledger, node: str) -> dict[int, dict[str, float]]:
    """step -> {"upload_started": ts, "upload_done": ts} of the state objects `node` uploaded."""
    out: dict[int, dict[str, float]] = {}
    for e in ledger.entries:
        if e["node"] == node and e["event"] in ("upload_started", "upload_done") and e["step"] is not None:
            out.setdefault(e["step"], {})[e["event"]] = e["ts"]
    return out


@pytest.mark.timeout(240)
def test_a_notice_during_an_upload_never_loads_a_torn_checkpoint(local: Petctl, tmp_path: Path):
    ledger_dir = tmp_path / "ledger"
    run_ledger_job(local, ledger_dir, "torn", "--min", "1", "--max", "2", "--size", "2",
                   "--replace-delay", "600", "--wait", "--wait-timeout", "120", STEPS=STEPS,
                   CKPT_EVERY=EVERY, STEP_TIME=0.1, UPLOAD_SECONDS=UPLOAD, PETCTL_SNAPSHOTS=0,
                   UPLOAD_HELD=ledger_dir / "upload_ends")
    checkpoints = local.job_dir("torn") / "checkpoints"
    started = wait_until(lambda: Ledger.read(ledger_dir).of("upload_started"), 90, "the first upload")
    slow_padding(ledger_dir)  # no periodic save of step 99 comes while the CLI call below starts up
    writer = started[0]["node"]
    assert started[0]["step"] == EVERY - 1 and started[0]["rank"] == 0

    local.run("chaos", "torn", "--node", writer, "--notice", "--grace", str(GRACE))
    reclaim_at = json.loads((local.job_dir("torn") / "notices" / f"{writer}.json").read_text())["time"]
    # The upload in flight ends UPLOAD / 2 s after the notice (or at once, if that has passed): before the
    # save's deadline, leaving too little time for a second upload.
    ends = ledger_dir / "upload_ends.tmp"
    ends.write_text(repr(reclaim_at - GRACE + UPLOAD / 2))
    ends.rename(ledger_dir / "upload_ends")
    # Once the writer is reclaimed (its torn upload can no longer finish) and the survivor trains alone,
    # the rest of the run only has to be done, and right: no more padded steps or throttled uploads.
    wait_until(lambda: time.time() > reclaim_at + 1 and any(
        e["world"] == 1 for e in Ledger.read(ledger_dir).of("step")), 120, "the survivor training alone")
    end_padding(ledger_dir)
    info = local.wait_finished("torn", timeout=200)
    assert info["state"] == "succeeded", info

    ledger = Ledger.read(ledger_dir)
    up = uploads(ledger, writer)
    t_notice = reclaim_at - GRACE
    (timeout,) = [e for e in local.events("torn", "preemption.save_timeout") if e["node"] == writer]
    # The notice's time (in whole seconds, seen a moment after it was written), less a quarter of it.
    save_deadline, margin = timeout["save_deadline"], GRACE * SHORT_NOTICE_SHARE
    assert reclaim_at - margin - 1 < save_deadline <= reclaim_at - margin + 0.5
    assert save_deadline <= timeout["ts"] < reclaim_at
    # The notice landed mid-upload: the upload of step 49 was in flight when it was written, and it
    # completed before the save deadline.
    assert up[EVERY - 1]["upload_started"] < t_notice < up[EVERY - 1]["upload_done"] < save_deadline, up
    # Every rank saw the flag at the same step j; rank 0's preemption save of j was cut off at the deadline.
    torn = max(up)
    assert torn > EVERY - 1 and "upload_done" not in up[torn] and up[torn]["upload_started"] < save_deadline
    ran = {e["step"] for e in ledger.of("step") if e["node"] == writer}
    assert max(ran) == torn  # it was saving the step it had just run, and ran no further
    assert torn in data_steps(checkpoints) and torn not in manifests(checkpoints)  # data, no manifest
    assert not ledger.of("save_now_saved")  # no rank got to report the save done

    # The survivor resumed alone from the newest complete checkpoint, step 49, never from the torn one.
    runs = ledger.training_rounds()
    (survivor,) = set(runs[0].ranks) - {writer}
    assert [(sorted(r.ranks), r.worlds) for r in runs] == [(sorted([writer, survivor]), {2}),
                                                           ([survivor], {1})]
    assert {ran[-1] for ran in runs[0].steps.values()} == {torn}  # both ranks stopped at the flagged step
    assert runs[1].loaded == {EVERY - 1} and runs[1].first == EVERY
    assert ledger.redone() == [torn - (EVERY - 1)]  # the steps since the complete checkpoint, no more
    ledger.assert_exact(STEPS, ledger_dir / "final.json")  # every step, and the end, bit for bit
    loaded = [e for e in local.events("torn", "checkpoint.loaded") if e["node"] == survivor]
    assert [e["step"] for e in loaded] == [EVERY - 1]

    # The noticed node left on its own once the save deadline passed, and ended its instance itself
    # (it had left its group at the notice): billed until then, not until the reclaim.
    (left,) = [e for e in local.events("torn", "agent.left") if e["node"] == writer]
    assert left["cause"] == "preemption" and save_deadline <= left["ts"] < reclaim_at
    timeline = local.json("events", "torn", "--all")
    assert not [e for e in timeline if e["event"] == "instance.reclaimed"]
    rows = {r["id"]: r for r in json.loads((local.job_dir("torn") / "instances.json").read_text())}
    assert rows[writer]["detached_at"] is not None and rows[writer]["ended_at"] < reclaim_at, rows[writer]
    assert rows[writer]["reason"] == "detached, then ended by its agent", rows[writer]
    assert left["ts"] <= rows[writer]["shutdown_at"] == rows[writer]["ended_at"], rows[writer]
    assert len(local.processes()) == 1  # etcd only
