"""Sharded (FSDP2) checkpoints through torch.distributed.checkpoint on the same store and manifests:
two gloo processes save their own shards, a save-now flag on one rank stops both at the same step,
the resumed run continues at that step + 1 with the same weights, and a half-written save is ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from petctl.elastic import manifest as mf
from petctl.elastic import open_object_store
from tests.support.helpers_gloo import WORKER_PRELUDE, run_worker_pair

WORKER = WORKER_PRELUDE + r'''
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from petctl.elastic import ShardedCheckpointer, ShardedState

torch.manual_seed(1 if mode == "train" else 2)  # the resumed run starts from other weights on purpose
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
app = {"app": ShardedState(model, opt, extra={"step": -1})}
ckpt = ShardedCheckpointer(every=2)
start = ckpt.resume(app)
exited_at = None
if mode == "train":
    for step in range(start, start + 50):
        torch.manual_seed(step)
        loss = model(torch.randn(8, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        app["app"].extra["step"] = step
        if rank == 1 and step == 4:
            controlfiles.write_save_now(os.environ["PETCTL_CONTROL_DIR"], "node-1", deadline=1e12)
        if ckpt.step_end(step, app):
            exited_at = step
            break
ckpt.close()
full = [p.full_tensor().flatten().tolist() for p in model.parameters()]
out.write_text(json.dumps({"start": start, "exited_at": exited_at, "params": full,
                           "extra": app["app"].extra}))
dist.destroy_process_group()
'''


def run_pair(tmp_path: Path, mode: str, url: str) -> list[dict]:
    return run_worker_pair(tmp_path, WORKER, mode, url, tag=mode, timeout=240,
                           rank_env=lambda rank: {"PETCTL_CACHE_DIR": str(tmp_path / f"cache-{rank}-{mode}")})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_save_now_save_and_resharded_resume(tmp_path: Path) -> None:
    from petctl.io import controlfiles

    url = (tmp_path / "ckpt").as_uri()
    r0, r1 = run_pair(tmp_path, "train", url)
    assert r0["exited_at"] == r1["exited_at"] == 4
    assert controlfiles.read_saved(tmp_path / "control-0") == {0: 4}
    assert controlfiles.read_saved(tmp_path / "control-1") == {0: 4}
    store = open_object_store(url)
    assert mf.manifest_steps(store) == [4, 3, 1]
    names = {e.name for e in mf.read_manifest(store, 4).objects}
    assert names == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # every rank's shards

    # A later save cut off on one rank: shards and entries of rank 0 only, no manifest.
    for key in [o.key for o in store.list(mf.data_prefix(4))]:
        if "__0_" in key or "_entries/0" in key:
            store.put_bytes(key.replace(mf.data_prefix(4), mf.data_prefix(9)), store.get_bytes(key))
    for rank in range(2):
        controlfiles.clear(tmp_path / f"control-{rank}", markers=True)
    a, b = run_pair(tmp_path, "resume", url)
    assert a["start"] == b["start"] == 5
    assert a["params"] == b["params"] == r0["params"]
    assert a["extra"] == b["extra"] == {"step": 4}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_seconds_saves_when_due_and_restarts_the_clock(tmp_path: Path, monkeypatch) -> None:
    """Single process (no torch.distributed): the sharded checkpointer has the time cadence too."""
    import types

    import torch

    from petctl.elastic import checkpointer as basecheckpointer
    from petctl.elastic.sharded import ShardedCheckpointer

    now = [1000.0]
    monkeypatch.setattr(basecheckpointer, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    url = (tmp_path / "ckpt").as_uri()
    app = {"w": torch.arange(4.0)}
    with ShardedCheckpointer(url, keep=10, every_seconds=60, background=False,
                             local_dir=tmp_path / "dcp", control_dir=tmp_path / "control") as ckpt:
        for step, advance in enumerate([59, 1, 59, 2, 30]):
            now[0] += advance
            assert ckpt.step_end(step, app) is False
    assert mf.manifest_steps(open_object_store(url)) == [3, 1]  # due at 60 s, then 60 s after the save of 1


def test_every_seconds_needs_the_save_now_check_to_agree_on(tmp_path: Path) -> None:
    from petctl.elastic.sharded import ShardedCheckpointer

    with pytest.raises(ValueError, match="check_every"):
        ShardedCheckpointer((tmp_path / "ckpt").as_uri(), every_seconds=60, check_every=0)


CLOCK_WORKER = WORKER_PRELUDE + r'''
import types
from petctl.elastic import checkpointer as basecheckpointer
from petctl.elastic.sharded import ShardedCheckpointer

now = [1000.0]
basecheckpointer.time = types.SimpleNamespace(monotonic=lambda: now[0])
app = {"w": torch.arange(4.0) + rank}
saved = []
with ShardedCheckpointer(every_seconds=60, check_every=2, background=False) as ckpt:
    for step in range(8):
        if rank == 1 and step == 2:
            now[0] += 61  # only rank 1's clock says a save is due
        ckpt.step_end(step, app)
        saved.append(ckpt._submitted_step)
out.write_text(json.dumps({"saved": saved}))
dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_agree_on_a_time_based_sharded_save(tmp_path: Path) -> None:
    """A sharded save is collective: a save due by one rank's clock is made by every rank, at the same
    (check) step, or the other rank would never enter dcp.save and the job would hang."""
    url = (tmp_path / "ckpt").as_uri()
    r0, r1 = run_worker_pair(tmp_path, CLOCK_WORKER, "train", url, tag="clock", timeout=240,
                             rank_env=lambda rank: {"PETCTL_CACHE_DIR": str(tmp_path / f"cache-{rank}")})
    assert r0["saved"] == r1["saved"] == [None, None, 2, 2, 2, 2, 2, 2]
    assert mf.manifest_steps(open_object_store(url)) == [2]


DATA_WORKER = r'''
import datetime, json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from petctl.elastic import ElasticSampler, ShardedCheckpointer, ShardedState

steps, out = int(sys.argv[1]), Path(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=60))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
sampler = ElasticSampler(60, batch_size=3, seed=11)
app = {"app": ShardedState(model, opt, stateful={"sampler": sampler})}
ckpt = ShardedCheckpointer(every=5)
start = ckpt.resume(app)
read, it = [], iter(sampler)
for step in range(start, start + steps):
    idx = [next(it) for _ in range(sampler.plan.per_rank)]
    shares = [None] * world
    dist.all_gather_object(shares, idx)
    read.append([s[i] for i in range(len(idx)) for s in shares])
    loss = model(torch.randn(len(idx), 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ckpt.step_end(step, app)
ckpt.close()
cursor = [sampler.cursor.epoch, sampler.cursor.offset]
out.write_text(json.dumps({"start": start, "read": read, "cursor": cursor}))
dist.destroy_process_group()
'''


def run_data_ranks(tmp_path: Path, world: int, steps: int, url: str, tag: str) -> list[dict]:
    import sys

    from petctl.io.procs import free_port
    from tests.support.helpers_gloo import run_ranks

    script = tmp_path / "data_worker.py"
    script.write_text(DATA_WORKER)
    port = free_port()
    outs = [tmp_path / f"{tag}-{rank}.json" for rank in range(world)]
    return run_ranks([[sys.executable, str(script), str(steps), str(out)] for out in outs],
                     lambda rank: {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "PETCTL_CHECKPOINT_URL": url,
                                   "PETCTL_CACHE_DIR": str(tmp_path / f"cache-{tag}-{rank}")},
                     outs, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resharded_resume_continues_the_data_at_the_same_global_position(tmp_path: Path) -> None:
    """FSDP at world 2 saves after step 4 (DCP, every 5 steps); the job resumes at world 1 (DCP reshards
    the weights) and reads on from position 30 of the epoch's order: nothing twice, nothing skipped."""
    url = (tmp_path / "ckpt").as_uri()
    r0, r1 = run_data_ranks(tmp_path, 2, 5, url, "two")
    assert r0["read"] == r1["read"] and r0["cursor"] == [0, 30]
    (alone,) = run_data_ranks(tmp_path, 1, 4, url, "one")
    assert alone["start"] == 5 and alone["cursor"] == [0, 42]
    from petctl.elastic import ElasticSampler

    order = ElasticSampler(60, batch_size=1, seed=11, rank=0, world_size=1).order(0).tolist()
    stream = [i for step in r0["read"] + alone["read"] for i in step]
    assert stream == order[:42]
