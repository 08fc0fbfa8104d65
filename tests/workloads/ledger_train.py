"""A petctl.elastic training job whose every step is on a ledger and whose weights are exact, bit for bit.

The fault-matrix tests (tests/test_matrix_*.py) run it through `petctl run_job` on the local provider.
Every rank appends one JSON line per event to `$LEDGER_DIR/<node>.<pid>.jsonl`:

    {"event": "resumed", "start": S, "loaded": S - 1 or null, ...}   the checkpoint it resumed from
    {"event": "step", "step": s, "digest": D, ...}                    step s done; D: the weights after it
    {"event": "upload_started" | "upload_done", "step": s, ...}       (rank 0, throttled store only)
    {"event": "save_now_saved", "step": s, ...}                       left on a save-now save
    {"event": "done", "step": s, ...}                                 every step done

each with `node`, `round` (PETCTL_ROUND), `rank`, `world` and `ts`. Rank 0 writes `$LEDGER_DIR/final.json`
({"steps", "weights": [float.hex], "digest"}) once the last step is done.

Why the weights are exact: they are float64, and each step's gradient is a function of the weights and the
step, rounded to a multiple of 2**-16 in [-1, 1]. The all-reduced sum of a few identical such values is
exact, so the sum divided by the world size is the gradient itself, bit for bit: the weights after step s
depend neither on the world size nor on the restarts, and `replay(n)` in one process gives the same bits.
A step lost, applied twice, or resumed from a torn or wrong checkpoint changes them. Every rank also checks
that the all-reduced gradient equals its own (ranks that resumed from different states fail loudly).

Env: STEPS, STEP_TIME (seconds slept per step; SLOW_TIME instead while the world is smaller than
SLOW_BELOW_WORLD, so a job cannot finish before the capacity a test waits for is in), CKPT_EVERY
(periodic save after every N steps), KEEP,
LEDGER_DIR (a test ends the step padding with `$LEDGER_DIR/unpadded`: tests/workloads/padding.py),
UPLOAD_SECONDS (rank 0's uploads of state go through `ThrottledStore`: that long per object),
UPLOAD_HELD (a file: the first upload stays in flight until the test writes it, then ends at the time it
holds; see `throttled_store`),
FAIL_AT (rank 0 raises at that step: a bug in the user's script).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from tests.workloads.padding import pad, padding_ended, wait_padded

DIM = 16
LR = 2.0 ** -4
MOMENTUM = 0.5
QUANTUM = 2.0 ** 16


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, DIM, dtype=torch.float64))
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def gradient(w: torch.Tensor, step: int) -> torch.Tensor:
    """Exactly representable, |g| <= 1, a function of the weights (so a wrong state shows)."""
    with torch.no_grad():
        return torch.round(torch.sin(3.0 * w + 0.05 * step) * QUANTUM) / QUANTUM


def weights_hex(model: torch.nn.Module) -> list[str]:
    return [float(v).hex() for v in model.w.detach().tolist()]


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(",".join(weights_hex(model)).encode()).hexdigest()[:16]


def replay(steps: int) -> tuple[list[str], list[str]]:
    """One process, no collectives: (the weights' digest after each step 0..steps-1, the final weights)."""
    model, opt = build()
    digests = []
    for step in range(steps):
        model.w.grad = gradient(model.w, step)
        opt.step()
        digests.append(digest(model))
    return digests, weights_hex(model)


class Ledger:
    def __init__(self, directory: Path, rank: int, world: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.node = os.environ.get("PETCTL_NODE_ID", "local")
        self.base = {"node": self.node, "round": int(os.environ.get("PETCTL_ROUND", "0")), "rank": rank,
                     "world": world}
        self.f = open(directory / f"{self.node}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def write(self, event: str, **fields) -> None:
        self.f.write(json.dumps({"ts": time.time(), "event": event, **self.base, **fields}) + "\n")
        self.f.flush()


def held_until(held: Path) -> float:
    """The time the test wrote into `held`, once it has: when the first upload is to end."""
    while True:
        try:
            return float(held.read_text())
        except (OSError, ValueError):  # not written yet (the test renames it into place whole)
            if padding_ended():
                return 0.0  # the test ended the padding: nothing is held any more
            time.sleep(0.05)


def throttled_store(url: str, seconds: float, ledger: Ledger, held: Path | None = None):
    """A file store as slow as a congested link: a checkpoint's data object takes `seconds` to upload,
    written straight to its key in 20 chunks (so a kill mid-upload leaves a truncated object, harsher than
    S3, where an object appears whole). The manifest, written after the data, is an ordinary atomic PUT.

    With `held`, the first object's upload stays in flight until the test writes a time into that file,
    and ends at that time. A test that acts during an upload then does not race the upload with its own
    CLI call, whose start-up on a loaded machine can take longer than the upload."""
    from petctl.io.objstore import FileStore, local_path

    first = [held]

    class ThrottledStore(FileStore):
        def put_file(self, key: str, path: Path) -> None:
            step = int(key.split("/")[0].rsplit("-", 1)[1]) if key.startswith("step-") else None
            ledger.write("upload_started", step=step, key=key)
            print(json.dumps({"ts": time.time(), "event": "store.put_started", "step": step, "key": key}),
                  flush=True)
            target = self._path(key)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = path.read_bytes()
            chunk = max(1, len(data) // 20 + 1)
            gate, first[0] = first[0], None
            with open(target, "wb") as out:
                if gate is not None:  # in flight, part written, until the test says when it ends
                    out.write(data[:chunk])
                    out.flush()
                    until = held_until(gate)
                    wait_padded(until - time.time())
                    out.write(data[chunk:])
                else:
                    for i in range(0, len(data), chunk):
                        out.write(data[i:i + chunk])
                        out.flush()
                        wait_padded(seconds / 20)  # a slow store's time is padding too: a test may end it
            ledger.write("upload_done", step=step, key=key)

    return ThrottledStore(local_path(url))


def main() -> int:
    import torch.distributed as dist

    from petctl.elastic import Checkpointer, State

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ledger = Ledger(Path(os.environ["LEDGER_DIR"]), rank, world)
    steps, fail_at = int(os.environ.get("STEPS", "100")), int(os.environ.get("FAIL_AT", "-1"))
    upload = float(os.environ.get("UPLOAD_SECONDS", "0"))
    held = Path(os.environ["UPLOAD_HELD"]) if os.environ.get("UPLOAD_HELD") else None
    step_time, slow_time = float(os.environ.get("STEP_TIME", "0.05")), float(os.environ.get("SLOW_TIME", "0"))
    slow_below = int(os.environ.get("SLOW_BELOW_WORLD", "0"))
    url = os.environ["PETCTL_CHECKPOINT_URL"]
    model, opt = build()
    state = State(model=model, optimizer=opt, extra={"step": -1})
    store = throttled_store(url, upload, ledger, held) if upload > 0 and rank == 0 else None
    ckpt = Checkpointer(keep=int(os.environ.get("KEEP", "100")),
                        every=int(os.environ.get("CKPT_EVERY", "10")), store=store)
    start = ckpt.resume(state)
    ledger.write("resumed", start=start, loaded=start - 1 if start else None)
    left = False
    for step in range(start, steps):
        if step == fail_at and rank == 0:
            raise RuntimeError(f"injected failure at step {step} (FAIL_AT)")
        local = gradient(model.w, step)
        total = local.clone()
        dist.all_reduce(total)
        shared = total / world
        if not torch.equal(shared, local):
            raise RuntimeError(f"ranks disagree at step {step}: they resumed from different states")
        model.w.grad = shared
        opt.step()
        state.extra["step"] = step
        ledger.write("step", step=step, digest=digest(model))
        print(json.dumps({"ts": time.time(), "event": "train.step", "step": step, "rank": rank,
                          "world_size": world}), flush=True)
        pad(step_time if world >= slow_below else slow_time)
        if ckpt.step_end(step, state):
            ledger.write("save_now_saved", step=step)
            left = True
            break
    ckpt.close()
    if not left:
        if rank == 0:
            final = Path(os.environ["LEDGER_DIR"]) / "final.json"
            tmp = final.with_suffix(".tmp")
            tmp.write_text(json.dumps({"steps": steps, "weights": weights_hex(model),
                                       "digest": digest(model)}))
            os.replace(tmp, final)
        ledger.write("done", step=steps - 1)
        dist.barrier()  # nobody exits (and looks like a lost peer) while rank 0 still writes
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
