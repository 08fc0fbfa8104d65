"""Sharded (FSDP2) in-memory snapshots with real gloo ranks on loopback, each rank its own node with its own
snapshot directory: 3 ranks train and snapshot every step (each keeps its shard and the previous node's);
one node's memory lost, 2 ranks resume from the snapshots with the exact weights of the uninterrupted
run (resharded 3 -> 2); two neighbouring nodes' memory lost, the resume falls back to the store and the
event names the old ranks whose shards are gone."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from petctl.core.eventlog import parse_lines
from petctl.io.procs import free_port
from tests.support.helpers_gloo import run_ranks

WORKER = r'''
import datetime, json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from petctl.io.eventlog import EventLog
from petctl.elastic import ShardedCheckpointer, ShardedState
from petctl.elastic.snapshots import SnapshotOptions

mode, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=60))
torch.manual_seed(1 if mode == "train" else 2)  # a resumed run starts from other weights on purpose
model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).double()
fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
app = {"app": ShardedState(model, opt, extra={"step": -1})}
events = open(out.with_suffix(".events"), "w")
ckpt = ShardedCheckpointer(every=4, background=False, snapshots=SnapshotOptions(every=1),
                           log=EventLog("elastic", stream=events, rank=rank))
start = ckpt.resume(app)
for step in range(start, steps):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(12, 6, generator=gen, dtype=torch.float64)[rank::world]
    loss = model(x).pow(2).sum() * world / 12  # FSDP averages gradients over ranks: the global batch's
    opt.zero_grad()
    loss.backward()
    opt.step()
    app["app"].extra["step"] = step
    ckpt.step_end(step, app)
ckpt.close()
full = [v for p in model.parameters() for v in p.full_tensor().flatten().tolist()]
out.write_text(json.dumps({"start": start, "params": full, "extra": app["app"].extra}))
dist.destroy_process_group()
'''


def run_nodes(base: Path, tag: str, mode: str, world: int, steps: int, round_no: int,
              nodes: list[int]) -> list[dict]:
    """`world` ranks of WORKER; rank i runs on node `nodes[i]` (its snapshot directory base/shm-<node>),
    all checkpointing to base/ckpt."""
    tmp_path = base
    tmp_path.mkdir(exist_ok=True)
    for node in nodes:
        (tmp_path / f"shm-{node}").mkdir(exist_ok=True)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()

    def env_of(rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "PETCTL_CHECKPOINT_URL": (tmp_path / "ckpt").as_uri(),
                "PETCTL_CONTROL_DIR": str(tmp_path / f"control-{rank}"),
                "PETCTL_CACHE_DIR": str(tmp_path / f"cache-{nodes[rank]}"),
                "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"shm-{nodes[rank]}"), "PETCTL_JOB": "job",
                "PETCTL_ROUND": str(round_no)}

    outs = [tmp_path / f"{tag}-{rank}.json" for rank in range(world)]
    return run_ranks([[sys.executable, str(script), mode, str(out), str(steps)] for out in outs], env_of,
                     outs, timeout=240)


def events(tmp_path: Path, tag: str, world: int, name: str) -> list[dict]:
    out = []
    for rank in range(world):
        lines = (tmp_path / f"{tag}-{rank}.events").read_text().splitlines()
        out += [e for e in parse_lines(lines) if e["event"] == name]
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_node_lost_resumes_from_shards_two_lost_fall_back_to_the_store(tmp_path: Path) -> None:
    full = run_nodes(tmp_path / "whole", "full", "train", 3, 10, 1, [0, 1, 2])  # uninterrupted, to step 9
    trained = run_nodes(tmp_path, "train", "train", 3, 6, 1, [0, 1, 2])  # store: step 3; snapshots: step 5
    assert trained[0]["extra"] == {"step": 5}
    for node in range(3):
        names = sorted(p.name for p in (tmp_path / f"shm-{node}").iterdir())
        assert names == ["shard-own-0.snap", "shard-peer-0.snap"], names  # one own shard, one peer copy

    kept = tmp_path / "kept"  # the memory and the store as they were at this moment
    for name in ("ckpt", "shm-0", "shm-1", "shm-2"):
        shutil.copytree(tmp_path / name, kept / name)

    shutil.rmtree(tmp_path / "shm-1")  # node 1 (old rank 1) lost: its shard lives on in node 2's memory
    loaded = run_nodes(tmp_path, "one", "train", 2, 6, 2, [0, 2])  # resume, no step
    assert [r["start"] for r in loaded] == [6, 6]  # the snapshot of step 5, not the store's step 3
    assert loaded[0]["params"] == loaded[1]["params"] == trained[0]["params"]  # exact, resharded 3 -> 2
    assert loaded[0]["extra"] == {"step": 5}
    (line,) = events(tmp_path, "one", 2, "snapshot.resume")
    holders = {"0": 0, "1": 1, "2": 0}  # old rank 1's copy on node 2 (new rank 1), 2's own and on node 0
    assert (line["step"], line["world"], line["holders"]) == (5, 3, holders)
    resumed = run_nodes(tmp_path, "on", "train", 2, 10, 3, [0, 2])  # and on to step 9 at world 2
    assert [r["start"] for r in resumed] == [6, 6]
    dw = max(abs(a - b) for a, b in zip(resumed[0]["params"], full[0]["params"], strict=True))
    assert dw <= 1e-12, dw  # the same steps; 2 ranks' sums round differently from 3's

    # Nodes 1 and 2 lost at once: old rank 1's shard and its only copy (node 2's) are gone. Node 0 and a
    # fresh node 3 resume from the store's step 3, and say why.
    two = tmp_path / "two"
    for name in ("ckpt", "shm-0"):
        shutil.copytree(kept / name, two / name)
    back = run_nodes(two, "two", "train", 2, 10, 2, [0, 3])
    assert [r["start"] for r in back] == [4, 4]
    dw = max(abs(a - b) for a, b in zip(back[0]["params"], full[0]["params"], strict=True))
    assert dw <= 1e-12, dw
    assert not events(two, "two", 2, "snapshot.resume")
    (line,) = events(two, "two", 2, "snapshot.fallback")
    assert line["source"] == "store" and line["missing"] == [1], line
    assert "lost at once" in line["reason"]
