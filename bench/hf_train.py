"""The benchmark's Hugging Face workload (`bench/run.py --workload hf`): examples/hf_trainer.py unchanged.

The README-style Trainer script with its one line (`callbacks=[PetctlCallback()]`), at the bench's
cadence: its own checkpoints every 10 steps (`--save-steps`), each step padded to at least 50 ms, endless
(`--steps` 10^6). The callback's `train.step` lines (local rank 0 of each node) are what the benchmark
reads, and `checkpoint.resumed` times the start-up. Runs unchanged under petctl and under torchrun (the
example puts its checkpoints in `$PETCTL_CHECKPOINT_URL`'s directory, which both runners set).
"""

import sys
import time

from transformers import TrainerCallback

from examples.hf_trainer import main

STEP_TIME = 0.05


class Pace(TrainerCallback):
    """Pads each step to STEP_TIME (the bench's step), as bench/user_train.py does."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(max(0.0, STEP_TIME - (time.monotonic() - self.t0)))
        self.t0 = time.monotonic()


if __name__ == "__main__":
    main(["--steps", "1000000", "--save-steps", "10", *sys.argv[1:]], callbacks=[Pace()])
