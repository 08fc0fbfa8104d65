"""Two real ranks with gloo on loopback, each its own node with its own snapshot directory: a resume takes
the newest snapshot any rank holds and broadcasts it from that rank (rank 1 here, to a rank 0 that lost
its memory, as a replacement node would), and falls back to the store when the only snapshot is damaged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from petctl.core.eventlog import parse_lines
from petctl.core.snapshotrecord import HEADER_SIZE
from tests.support.helpers_gloo import WORKER_PRELUDE, run_worker_pair

WORKER = WORKER_PRELUDE + r'''
from petctl.io.eventlog import EventLog
from petctl.elastic import Checkpointer, State
from petctl.elastic.snapshots import SnapshotOptions

torch.manual_seed(100 + rank)  # different on purpose: only a resume can make the ranks equal
net = torch.nn.Linear(4, 2)
model = torch.nn.parallel.DistributedDataParallel(net) if mode == "train" else net
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = State(model=model, optimizer=opt, extra={"step": -1})
events = open(out.with_suffix(".events"), "w")
ckpt = Checkpointer(every=4, background=False, snapshots=SnapshotOptions(every=1),
                    log=EventLog("elastic", stream=events, rank=rank))
start = ckpt.resume(state)
if mode == "train":
    for step in range(start, 10):
        torch.manual_seed(step)
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.extra["step"] = step
        ckpt.step_end(step, state)
ckpt.close()
params = [p.detach().flatten().tolist() for p in net.parameters()]
momenta = [s["momentum_buffer"].flatten().tolist() for s in opt.state.values()]
out.write_text(json.dumps({"start": start, "params": params, "momenta": momenta, "extra": state.extra}))
dist.destroy_process_group()
'''


def run_pair(tmp_path: Path, mode: str, url: str, round_no: int) -> list[dict]:
    return run_worker_pair(tmp_path, WORKER, mode, url, tag=f"{mode}-{round_no}", timeout=180,
                           rank_env=lambda rank: {
                               "PETCTL_CACHE_DIR": str(tmp_path / f"cache-{rank}"),
                               "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"shm-{rank}"), "PETCTL_JOB": "job",
                               "PETCTL_ROUND": str(round_no)})


def events(tmp_path: Path, mode: str, round_no: int, name: str) -> list[dict]:
    """Event `name` of both ranks' run of `mode` in `round_no`, rank 0 first."""
    out = []
    for rank in range(2):
        lines = (tmp_path / f"{mode}-{round_no}-{rank}.events").read_text().splitlines()
        out += [e for e in parse_lines(lines) if e["event"] == name]
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_replacement_rank_gets_the_survivors_snapshot_and_a_damaged_one_falls_back(tmp_path: Path) -> None:
    url = (tmp_path / "ckpt").as_uri()
    for rank in range(2):
        (tmp_path / f"shm-{rank}").mkdir()
    trained = run_pair(tmp_path, "train", url, round_no=1)  # store: step 7; snapshots: step 9 on both
    assert trained[0]["params"] == trained[1]["params"]

    shutil.rmtree(tmp_path / "shm-0")  # rank 0's node was replaced: its memory is gone
    (tmp_path / "shm-0").mkdir()
    shutil.rmtree(tmp_path / "cache-0", ignore_errors=True)
    a, b = run_pair(tmp_path, "resume", url, round_no=2)
    assert a["start"] == b["start"] == 10  # the survivor's snapshot of step 9, not the store's step 7
    for got in (a, b):
        assert (got["params"], got["momenta"], got["extra"]) == (
            trained[1]["params"], trained[1]["momenta"], {"step": 9})
    assert [e["source"] for e in events(tmp_path, "resume", 2, "checkpoint.resumed")] == ["snapshot"] * 2
    assert {e["holder"] for e in events(tmp_path, "resume", 2, "checkpoint.loaded")} == {1}  # sent by rank 1

    snap = tmp_path / "shm-1" / "state.snap"
    data = bytearray(snap.read_bytes())
    data[HEADER_SIZE + 3] ^= 0x01  # one bit of the survivor's snapshot flipped
    snap.write_bytes(bytes(data))
    a, b = run_pair(tmp_path, "resume", url, round_no=3)
    assert a["start"] == b["start"] == 8  # never the damaged snapshot: the store's step 7
    assert a["extra"] == b["extra"] == {"step": 7}
    assert [e["source"] for e in events(tmp_path, "resume", 3, "checkpoint.resumed")] == ["store", "store"]
    skipped = {e["rank"]: e["reason"] for e in events(tmp_path, "resume", 3, "snapshot.skipped")}
    assert skipped[1].startswith("checksum")
    # rank 0's worker of round 2 mapped its file after resuming but took no step: a blank header
    assert skipped[0].startswith("no committed snapshot")
