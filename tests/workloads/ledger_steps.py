"""A resumable job whose final weights depend on exactly which steps were applied, once each.

Every rank computes step `s`'s gradient on the same input (seeded by `s`) and applies rank 0's (a
broadcast, the collective that stalls when a peer is cut off), so the update of a step does not depend on
the world size and the weights after STEPS steps equal `reference_weights(STEPS)` bit for bit, however the
job was re-formed on the way, as long as no step was applied twice or skipped in the final lineage.
Prints one JSON line per step (`train.step`) and per resume (`train.resumed`); rank 0 of the round that
completes writes the final weights to $RESULT_DIR/weights-<node>.json.
Env: STEPS, STEP_TIME, CKPT_EVERY, KEEP, RESULT_DIR.
"""

import json
import os
import sys
import time

import torch

LR = 0.05


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Linear(8, 4)


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(step))


def reference_weights(steps: int) -> list[list[float]]:
    """What the job must end with: the same steps applied once each, in one process."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def say(record: dict) -> None:
    """One ledger line in ONE write: print() writes the text and the newline separately, and the
    checkpointer's background thread may log between the two, gluing two records into one line."""
    sys.stdout.write(json.dumps({"ts": time.time(), **record}) + "\n")
    sys.stdout.flush()


def main() -> None:
    import torch.distributed as dist

    from petctl.elastic import Checkpointer, State

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = State(model=model, optimizer=opt, extra={"step": -1})
    ckpt = Checkpointer(keep=int(os.environ.get("KEEP", "1000")),
                        every=int(os.environ.get("CKPT_EVERY", "5")))
    start = ckpt.resume(state)
    node = os.environ.get("PETCTL_NODE_ID", "")
    say({"event": "train.resumed", "step": start, "rank": rank, "world_size": world, "node": node})
    steps = int(os.environ.get("STEPS", "100"))
    for step in range(start, steps):
        opt.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        for p in model.parameters():
            dist.broadcast(p.grad, src=0)
        opt.step()
        state.extra["step"] = step
        say({"event": "train.step", "step": step, "rank": rank, "world_size": world, "node": node})
        time.sleep(float(os.environ.get("STEP_TIME", "0.1")))
        if ckpt.step_end(step, state):
            break
    ckpt.close()
    if rank == 0 and state.extra["step"] == steps - 1 and os.environ.get("RESULT_DIR"):
        weights = [p.detach().flatten().tolist() for p in model.parameters()]
        out = os.path.join(os.environ["RESULT_DIR"], f"weights-{node}.json")
        with open(out, "w") as f:
            json.dump({"round": os.environ.get("PETCTL_ROUND"), "weights": weights}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
