"""A DDP job that reads its data through `ElasticSampler`, with a ledger of every sample each step read.

tests/e2e/test_data_exactly_once.py runs it through `petctl run_job` on the local provider. Rank 0 gathers the
indices every rank read in a step (all_gather_object) and appends one JSON line per step to
`$LEDGER_DIR/data.jsonl`:

    {"event": "step", "step": s, "indices": [...in the stream's order...], "world": W, "round": R, ...}
    {"event": "resumed", "start": S, "cursor": [epoch, offset], ...}

and `$LEDGER_DIR/final.json` ({"steps", "weights": [float]}) once every step is done.

The model is written the way a user writes it: DDP, the DataLoader's batch is the plan's micro-batch,
each micro-batch's mean loss divided by the plan's accumulation, `no_sync` on all but the last. With a fixed
global batch, `replay` (one process, world 1) applies the same steps to the same samples: the run's final
weights should equal it within float tolerance whatever the world did.

Holds: at each step in HOLD_AT (after `step_end`) every rank waits, in lockstep, until the test writes
`$LEDGER_DIR/go-<step>` or petctl asks for a save (a planned change or a notice's hand-off: the hold ends,
the next step saves and leaves). So a test can act at a known step without racing the training.

An open end (END_FILE=1, for bench/soak.py, which does not know how many steps its faults will take):
STEPS is only a ceiling; once `$LEDGER_DIR/end` holds a step count, every rank stops there (each step the
ranks agree on the smallest count any of them read, so they stop together), and final.json says how many.
Each rank also writes `$LEDGER_DIR/pids/<round>-<rank>` ({"pid", "node", "round", "rank"}) when it
starts, so a soak can crash one worker process of a node, and prints a `train.step` line a step (what
`petctl status` accounts from).

Env: DATA_SIZE, BATCH (per rank) or GLOBAL_BATCH (+ MICRO), STEPS, STEP_TIME, CKPT_EVERY, HOLD_AT
(comma-separated steps), HOLD_LIMIT (seconds a hold waits at most), SEED, LEDGER_DIR, END_FILE.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

DIM = 6
LR = 0.05
MOMENTUM = 0.9


def dataset(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, the same in every process: sample i is row i."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size, DIM, generator=g, dtype=torch.float64)
    w = torch.linspace(-1.0, 1.0, DIM, dtype=torch.float64)
    return x, x @ w + 0.1 * torch.randn(size, generator=g, dtype=torch.float64)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1).double()
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def sampler_kwargs() -> dict:
    env = os.environ
    if env.get("GLOBAL_BATCH"):
        micro = env.get("MICRO")
        return {"global_batch": int(env["GLOBAL_BATCH"]), "micro_batch": int(micro) if micro else None}
    return {"batch_size": int(env.get("BATCH", "2"))}


def train_step(model, opt, batches, accumulation: int, xs, ys, ddp=None) -> None:
    """One optimizer step over `accumulation` micro-batches of indices."""
    opt.zero_grad()
    for i, idx in enumerate(batches):
        last = i == accumulation - 1
        ctx = ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext()
        with ctx:
            out = (ddp or model)(xs[idx]).squeeze(1)
            loss = torch.nn.functional.mse_loss(out, ys[idx]) / accumulation
            loss.backward()
    opt.step()


def replay(steps: int, size: int, global_batch: int, seed: int) -> list[float]:
    """One process at world 1, the same global batch and order: the weights after `steps` steps."""
    from petctl.elastic import ElasticSampler

    xs, ys = dataset(size)
    model, opt = build()
    sampler = ElasticSampler(size, global_batch=global_batch, rank=0, world_size=1, seed=seed)
    it = iter(sampler)
    for step in range(steps):
        idx = []
        for _ in range(global_batch):
            try:
                idx.append(next(it))
            except StopIteration:
                it = iter(sampler)
                idx.append(next(it))
        train_step(model, opt, [torch.tensor(idx)], 1, xs, ys)
        sampler.step_done(step)
    return weights(model)


def weights(model: torch.nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().flatten().tolist()]


def hold(step: int, ledger_dir: Path, ckpt, limit: float) -> None:
    """Wait (every rank, in lockstep) until the test says go or petctl asks for a save."""
    import torch.distributed as dist

    deadline = time.monotonic() + limit
    while True:
        flags = torch.tensor([int((ledger_dir / f"go-{step}").exists()),
                              int(ckpt.monitor.local_flag() or ckpt.monitor.pending_request() > 0),
                              int(time.monotonic() > deadline)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags.any():
            return
        time.sleep(0.1)


def end_step(ledger_dir: Path, steps: int) -> int:
    """The step count to stop at, agreed by every rank: the smallest of STEPS and the counts they read in
    `end` (written once, atomically, by the soak)."""
    import torch.distributed as dist

    try:
        wanted = min(steps, int((ledger_dir / "end").read_text()))
    except (OSError, ValueError):  # not written yet: train on
        wanted = steps
    agreed = torch.tensor([wanted])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


def record_pid(ledger_dir: Path, rank: int) -> None:
    """Where this rank's process is, for a soak that crashes one (`pids/<round>-<rank>`)."""
    pids = ledger_dir / "pids"
    pids.mkdir(exist_ok=True)
    rnd = int(os.environ.get("PETCTL_ROUND", "0"))
    tmp = pids / f".{rnd}-{rank}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "node": os.environ.get("PETCTL_NODE_ID", "local"),
                               "round": rnd, "rank": rank}))
    os.replace(tmp, pids / f"{rnd}-{rank}")


def main() -> int:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from petctl.elastic import Checkpointer, ElasticSampler, State, endless

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = os.environ
    ledger_dir = Path(env["LEDGER_DIR"])
    size, steps = int(env.get("DATA_SIZE", "30")), int(env.get("STEPS", "40"))
    holds = {int(s) for s in env.get("HOLD_AT", "").split(",") if s}
    step_time, limit = float(env.get("STEP_TIME", "0.05")), float(env.get("HOLD_LIMIT", "120"))
    xs, ys = dataset(size)
    model, opt = build()
    sampler = ElasticSampler(size, seed=int(env.get("SEED", "7")), **sampler_kwargs())
    plan = sampler.plan
    state = State(model=model, optimizer=opt, stateful={"sampler": sampler})
    ckpt = Checkpointer(keep=100, every=int(env.get("CKPT_EVERY", "5")))
    start = ckpt.resume(state)  # before iter(loader): the cursor is the kept step's
    ddp = DistributedDataParallel(model)
    loader = DataLoader(list(range(size)), batch_size=plan.micro_batch, sampler=sampler)
    log = open(ledger_dir / "data.jsonl", "a", buffering=1) if rank == 0 else None  # noqa: SIM115

    def write(event: str, **fields) -> None:
        if log is not None:
            log.write(json.dumps({"ts": time.time(), "event": event, "world": world,
                                  "round": int(env.get("PETCTL_ROUND", "0")),
                                  "node": env.get("PETCTL_NODE_ID", "local"), **fields}) + "\n")

    open_end = env.get("END_FILE") == "1"
    if open_end:
        record_pid(ledger_dir, rank)
    write("resumed", start=start, cursor=[sampler.cursor.epoch, sampler.cursor.offset])
    batches = endless(loader)
    left = False
    step = start
    while step < (end_step(ledger_dir, steps) if open_end else steps):
        micro = [next(batches) for _ in range(plan.accumulation)]
        train_step(model, opt, micro, plan.accumulation, xs, ys, ddp)
        mine = [i for b in micro for i in b.tolist()]
        shares: list = [None] * world
        dist.all_gather_object(shares, mine)
        stream = [share[i] for i in range(len(mine)) for share in shares]  # position r + i * world
        write("step", step=step, indices=stream)
        if open_end:  # what `petctl status` counts steps from (its accounting, checked by the soak)
            print(json.dumps({"ts": time.time(), "event": "train.step", "step": step, "rank": rank,
                              "world_size": world}), flush=True)
        if step_time:
            time.sleep(step_time)
        if ckpt.step_end(step, state):
            write("left", step=step)
            left = True
            break
        if step in holds:
            hold(step, ledger_dir, ckpt, limit)
        step += 1
    ckpt.close()
    if not left:
        if rank == 0:
            final = ledger_dir / "final.json"
            tmp = final.with_suffix(".tmp")
            tmp.write_text(json.dumps({"steps": max(step, start), "weights": weights(model)}))
            os.replace(tmp, final)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
