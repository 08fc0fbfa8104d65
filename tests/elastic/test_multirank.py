"""Two real worker processes with gloo on loopback: resume is read once (rank 0) and shared, and a
save-now flag raised on one rank's node makes both ranks save and stop at the same step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers_gloo import WORKER_PRELUDE, run_worker_pair

WORKER = WORKER_PRELUDE + r'''
from petctl.elastic import Checkpointer, State
from petctl.elastic import open_object_store

from tests.support.checkpointing import CountingStore

torch.manual_seed(100 + rank)  # different on purpose: resume must make the ranks equal
net = torch.nn.Linear(4, 2)
# DDP would copy rank 0's parameters to rank 1 by itself, so the resume run leaves it out: there the
# ranks can only agree through the broadcast checkpoint.
model = torch.nn.parallel.DistributedDataParallel(net) if mode == "train" else net
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = State(model=model, optimizer=opt, extra={"step": -1})
store = CountingStore(open_object_store(os.environ["PETCTL_CHECKPOINT_URL"]))
ckpt = Checkpointer(every=int(os.environ.get("EVERY", "0")), store=store)
start = ckpt.resume(state)
exited_at = None
if mode == "train":
    for step in range(start, start + 50):
        torch.manual_seed(step)
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.extra["step"] = step
        if rank == 1 and step == start + 5:  # this node's agent raises the flag (the other's does not)
            controlfiles.write_save_now(os.environ["PETCTL_CONTROL_DIR"], "node-1", deadline=0)
        if ckpt.step_end(step, state):
            exited_at = step
            break
ckpt.close()
params = [p.detach().flatten().tolist() for p in net.parameters()]
out.write_text(json.dumps({"start": start, "exited_at": exited_at, "reads": store.reads, "params": params,
                           "extra": state.extra}))
dist.destroy_process_group()
'''


def run_pair(tmp_path: Path, mode: str, url: str, tag: str) -> list[dict]:
    return run_worker_pair(tmp_path, WORKER, mode, url, tag=tag, timeout=180, rank_env=lambda rank: {
        "PETCTL_CACHE_DIR": str(tmp_path / f"cache-{rank}"),
        "EVERY": "4"})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_save_now_flag_on_one_rank_stops_all_at_same_step_then_resume_is_shared(
        tmp_path: Path, checkpoint_url: str) -> None:
    url = checkpoint_url  # s3: moto on loopback; the AWS_* env its fixture sets reaches the workers
    r0, r1 = run_pair(tmp_path, "train", url, "train")
    assert r0["start"] == r1["start"] == 0
    assert r0["exited_at"] == r1["exited_at"] == 5  # flag only in rank 1's control dir
    from petctl.io import controlfiles

    assert controlfiles.read_saved(tmp_path / "control-0") == {0: 5}
    assert controlfiles.read_saved(tmp_path / "control-1") == {0: 5}
    assert r0["params"] == r1["params"]

    for rank in range(2):  # the agent clears the control dir before the next round
        controlfiles.clear(tmp_path / f"control-{rank}")
    for rank in range(2):  # a new node: no local cache on either rank
        for f in (tmp_path / f"cache-{rank}").rglob("*"):
            if f.is_file():
                f.unlink()
    a, b = run_pair(tmp_path, "resume", url, "resume")
    assert a["start"] == b["start"] == 6  # zero lost steps: the step at the notice + 1
    assert a["params"] == b["params"] == r0["params"]
    assert a["extra"] == b["extra"] == {"step": 5}
    assert a["reads"] >= 2 and b["reads"] == 0  # only rank 0 touched the store
