"""P8's paired measurement: the cost of a snapshot at every step, in one process, steps with and without
snapshots interleaved in blocks, so a machine whose load swings from one minute to the next (this one's
does: other jobs share its 2 cores) weighs on both alike.

    python bench/snapcost.py [--mb 100] [--steps 300] [--block 10] [--step-time 0.1] [--overlap 1]

The workload's model (bench/workload.py: linear layers, SGD with momentum, one torch thread, a real
forward and backward padded to --step-time, a GPU step with the host CPU otherwise idle); blocks of
--block steps alternate between no snapshot and a snapshot at the end of every step (K fixed at 1, into
a file in /dev/shm, removed at the end). Prints one JSON line (`snapcost.result`): the mean step time of
each kind of block (the first block of each kind left out: warm-up), the overhead, and the writer's own
figures (`snapshot.stats`). With `--out PATH`, also writes it as a result tied to its commit, with the
machine and its load (bench/runmeta.py), and a table beside it.
"""

from __future__ import annotations

import argparse
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

from bench import runmeta  # noqa: E402
from bench.workload import build_model  # noqa: E402
from petctl.elastic import State  # noqa: E402
from petctl.elastic.snapshots.writer import SnapshotWriter  # noqa: E402
from petctl.io.eventlog import EventLog  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--overlap", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the result here (JSON, and its table as .md)")
    args = parser.parse_args(argv)
    meta = runmeta.start()  # the load before this run adds its own
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    state = State(model=model, optimizer=opt, extra={"step": -1})
    x = torch.randn(8, model[0].in_features)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    directory = Path(tempfile.mkdtemp(prefix="petctl-snapcost-", dir=base))
    quiet = EventLog("snapcost", stream=open(os.devnull, "w"))  # noqa: SIM115
    writer = SnapshotWriter(directory / "state.snap", "bench", 1, 0, 1, quiet, every=1,
                            overlap=bool(args.overlap))
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        writer.prepare(state)
        for step in range(args.steps):
            snap = (step // args.block) % 2 == 1
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            state.extra["step"] = step
            if snap:
                writer.take(step, state)
            spent = time.perf_counter() - t0
            if spent < args.step_time:
                time.sleep(args.step_time - spent)
            if step >= 2 * args.block:  # the first block of each kind: warm-up
                times[snap].append(time.perf_counter() - t0)
        writer.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    without, with_ = statistics.mean(times[False]), statistics.mean(times[True])
    result = {"event": "snapcost.result", "ts": time.time(), "mb": args.mb, "overlap": args.overlap,
              "step_s_without": round(without, 5), "step_s_with": round(with_, 5),
              "overhead_pct": round(100 * (with_ / without - 1), 3),
              "median_step_s_without": round(statistics.median(times[False]), 5),
              "median_step_s_with": round(statistics.median(times[True]), 5),
              "load_avg": os.getloadavg()[0], **writer.report()}
    print(json.dumps(result), flush=True)
    if args.out is not None:
        table = cost_table("snapshot at every step, one process", result)
        runmeta.write(meta, args.out, table, result=result)
    return 0


def cost_table(title: str, result: dict) -> str:
    """A result's headline as Markdown: the step time without and with a snapshot at every step, and the
    overhead (shared by bench/shardcost.py)."""
    rows = [("mean step without snapshots (s)", result["step_s_without"]),
            ("mean step with a snapshot every step (s)", result["step_s_with"]),
            ("overhead (%)", result["overhead_pct"]), ("parameters (MB)", result["mb"]),
            ("machine load at the end of the steps", round(result["load_avg"], 2))]
    return "\n".join([f"# {title}", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


if __name__ == "__main__":
    raise SystemExit(main())
