"""What ElasticSampler costs a training step, against DistributedSampler, in the same run.

    python bench/sampler.py                      # writes bench/results/sampler.json and .md

One process trains a small MLP on CPU from a map-style dataset through a DataLoader (batch 64, rank 1 of
4, no loader workers: the sampler's work lands on the training thread, its worst case). Each rep runs
the same steps twice, once per sampler, alternating which goes first, so drift in the machine's load
hits both alike. The ElasticSampler run also calls `step_done` each step, as `Checkpointer.step_end`
does. Per rep: the median step time of each; the figure is the median of the paired differences, beside
the spread of the baseline's own rep medians (the noise the difference must beat).

Also timed alone, without a model: drawing one step's indices, and starting an epoch (the permutation).

What it leaves out: a real dataset's reading and decoding (the same for both samplers), DataLoader
workers (which move the sampler's work off the training thread), and a world of processes (the sampler
only reads its rank and world size). A run that starts on a loaded machine (1-minute load average above
half the cores, read before the run starts) is marked INVALID and is not quoted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench import runmeta  # noqa: E402

RANK, WORLD, BATCH, DIM = 1, 4, 64, 64


def make_data(size: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, DIM, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def make_sampler(kind: str, data):
    from torch.utils.data import DistributedSampler

    from petctl.elastic import ElasticSampler

    if kind == "distributed":
        return DistributedSampler(data, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)
    return ElasticSampler(data, batch_size=BATCH, rank=RANK, world_size=WORLD, seed=0)


def train(kind: str, data, steps: int, warmup: int) -> float:
    """Median seconds per step over `steps` (after `warmup`) with sampler `kind`."""
    import torch
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sampler = make_sampler(kind, data)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    it = iter(loader)
    times = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if kind == "elastic":
            sampler.step_done(step)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def draw_cost(kind: str, data, steps: int) -> dict[str, float]:
    """Microseconds to draw one step's indices, and milliseconds to start an epoch, without a model."""
    sampler = make_sampler(kind, data)
    t0 = time.perf_counter()
    it = iter(sampler)
    next(it)  # the epoch's permutation is made on the first draw
    epoch_ms = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for step in range(steps):
        for _ in range(BATCH - (1 if step == 0 else 0)):
            next(it)
        if kind == "elastic":
            sampler.step_done(step)
    draw_us = 1e6 * (time.perf_counter() - t0) / steps
    return {"epoch_start_ms": round(epoch_ms, 3), "draw_us_per_step": round(draw_us, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--size", type=int, default=200_000, help="samples in the dataset")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "sampler.json")
    args = parser.parse_args(argv)
    meta = runmeta.start()  # the load before this run adds its own (torch's import included)
    import torch

    torch.set_num_threads(1)
    data = make_data(args.size)
    reps: list[dict[str, float]] = []
    for rep in range(args.reps):
        order = ["distributed", "elastic"] if rep % 2 == 0 else ["elastic", "distributed"]
        medians = {kind: train(kind, data, args.steps, args.warmup) for kind in order}
        reps.append({k: round(1e3 * v, 4) for k, v in medians.items()})
        print(json.dumps({"rep": rep, **reps[-1]}), flush=True)
    diffs = [r["elastic"] - r["distributed"] for r in reps]
    base = [r["distributed"] for r in reps]
    draws = {kind: draw_cost(kind, data, 500) for kind in ("distributed", "elastic")}
    cores = os.cpu_count() or 1
    load = meta["machine"]["load_avg_start"][0]
    loaded = load > cores / 2
    doc: dict[str, Any] = {
        **runmeta.finish(meta),
        "valid": not loaded,
        "invalid_reason": f"1-minute load {load} > {cores / 2}" if loaded else None,
        "setup": {"rank": RANK, "world": WORLD, "batch": BATCH, "dim": DIM, "size": args.size,
                  "steps": args.steps, "warmup": args.warmup, "threads": 1, "loader_workers": 0},
        "reps_ms_per_step": reps,
        "summary": {
            "distributed_ms": round(statistics.median(base), 4),
            "elastic_ms": round(statistics.median(r["elastic"] for r in reps), 4),
            "diff_ms_median": round(statistics.median(diffs), 4),
            "diff_ms_range": [round(min(diffs), 4), round(max(diffs), 4)],
            "baseline_noise_ms": round(max(base) - min(base), 4),
        },
        "draw": draws,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    s = doc["summary"]
    flag = "" if doc["valid"] else f" **INVALID: {doc['invalid_reason']}**"
    md = "\n".join([
        "# ElasticSampler's cost per step, against DistributedSampler",
        "",
        f"`{doc['command']}` at {doc['commit']} (dirty: {doc['dirty']}), {cores} cores, "
        f"load {meta['machine']['load_avg_start']} at start{flag}",
        "",
        "| | DistributedSampler | ElasticSampler | difference (median of paired reps) | baseline noise |",
        "|---|---|---|---|---|",
        f"| ms per training step | {s['distributed_ms']} | {s['elastic_ms']} | {s['diff_ms_median']:+} "
        f"({s['diff_ms_range'][0]:+} .. {s['diff_ms_range'][1]:+}) | {s['baseline_noise_ms']} |",
        f"| µs to draw a step's {BATCH} indices | {draws['distributed']['draw_us_per_step']} | "
        f"{draws['elastic']['draw_us_per_step']} | | |",
        f"| ms to start an epoch of {args.size} | {draws['distributed']['epoch_start_ms']} | "
        f"{draws['elastic']['epoch_start_ms']} | | |",
        "",
        "Leaves out: a real dataset's reading (the same for both), DataLoader workers, a world of processes.",
    ])
    args.out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
