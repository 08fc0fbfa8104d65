"""P8 for sharded state: the cost of a sharded in-memory snapshot at every step (own shard + the copy sent
to the next node), steps with and without snapshots interleaved in blocks as in bench/snapcost.py.

    python bench/shardcost.py [--mb 100] [--world 2] [--steps 200] [--block 10] [--step-time 0.1] [--every 1]

--world gloo processes on this machine, each its own "node" (its own snapshot directory in /dev/shm,
LOCAL_WORLD_SIZE 1), train bench/workload.py's model (--mb of parameters + momentum) sharded with FSDP2
(`fully_shard`), one torch thread each, a real forward and backward padded to --step-time; blocks of
--block steps alternate between no snapshot and a snapshot at the end of every step (K fixed at 1;
`--every auto` lets the cadence choose, as under the defaults; `--every N` fixes K at N).
Rank 0 prints one JSON line (`shardcost.result`): the mean step time of each kind of block (the first
block of each kind left out), the overhead, and its tier's own figures (`snapshot.stats`: the training
thread's wall time per snapshot, the optimizer step's wait for the copy, the copy, the exchange).
With `--out PATH`, also writes it as a result tied to its commit, with the machine and its load
(bench/runmeta.py), and a table beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench import runmeta  # noqa: E402
from bench.snapcost import cost_table  # noqa: E402
from bench.workload import build_model  # noqa: E402
from petctl.elastic.dist import Comm  # noqa: E402
from petctl.elastic.snapshots import SnapshotOptions  # noqa: E402
from petctl.elastic.snapshots.ring import ShardSnapshotTier  # noqa: E402
from petctl.elastic.state import ShardedState  # noqa: E402
from petctl.io.eventlog import EventLog  # noqa: E402


def run(rank: int, args: argparse.Namespace, port: int, base: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(args.world), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.mb)
    width = model[0].in_features
    fully_shard(model, mesh=init_device_mesh("cpu", (args.world,)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    app = {"app": ShardedState(model, opt, extra={"step": -1})}
    directory = Path(base) / f"node-{rank}"
    directory.mkdir()
    quiet = EventLog("shardcost", stream=open(os.devnull, "w"))  # noqa: SIM115
    options = SnapshotOptions(every=args.every, directory=str(directory))
    tier = ShardSnapshotTier(Comm.create(), quiet, options,
                             environ={"PETCTL_JOB": "bench", "PETCTL_ROUND": "1", "LOCAL_WORLD_SIZE": "1"})
    x = torch.randn(8, width)
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(args.steps):
        snap = (step // args.block) % 2 == 1
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        app["app"].extra["step"] = step
        if snap:
            tier.take(step, app)
        spent = time.perf_counter() - t0
        if spent < args.step_time:
            time.sleep(args.step_time - spent)
        if step >= 2 * args.block:
            times[snap].append(time.perf_counter() - t0)
    tier.close()
    if rank == 0:
        without, with_ = statistics.mean(times[False]), statistics.mean(times[True])
        line = json.dumps({"event": "shardcost.result", "ts": time.time(), "mb": args.mb, "world": args.world,
                           "step_s_without": round(without, 5), "step_s_with": round(with_, 5),
                           "overhead_pct": round(100 * (with_ / without - 1), 3),
                           "load_avg": os.getloadavg()[0], **tier.report(),
                           "cadence": "auto" if args.every is None else "fixed"})
        print(line, flush=True)
        (Path(base) / "result.json").write_text(line)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--every", default="1", help="K, or 'auto': the cadence's choice (the default's)")
    parser.add_argument("--out", type=Path, help="write the result here (JSON, and its table as .md)")
    args = parser.parse_args(argv)
    meta = runmeta.start()  # the load before this run adds its own
    if args.every == "auto":
        args.every = None
    elif not args.every.isdigit() or int(args.every) < 1:
        parser.error(f"--every takes a positive integer or 'auto', not {args.every!r}")
    else:
        args.every = int(args.every)
    from petctl.io.procs import free_port

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix="petctl-shardcost-", dir=base)
    try:
        mp.spawn(run, args=(args, free_port(), directory), nprocs=args.world, join=True)
        if args.out is not None:
            result = json.loads((Path(directory) / "result.json").read_text())
            title = f"sharded snapshot at every step, {args.world} ranks (FSDP2)"
            runmeta.write(meta, args.out, cost_table(title, result), result=result)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
