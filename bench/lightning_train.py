"""The benchmark's Lightning workload (`bench/run.py --workload lightning`): examples/lightning_ddp.py
unchanged, at the bench's cadence (ModelCheckpoint every 10 steps, steps padded to at least 50 ms,
endless), as bench/hf_train.py runs the Trainer example. The callback's `train.step` lines are what the
benchmark reads. Runs unchanged under petctl and under torchrun.
"""

import sys
import time

import lightning.pytorch as pl

from examples.lightning_ddp import main

STEP_TIME = 0.05


class Pace(pl.Callback):
    """Pads each step to STEP_TIME (the bench's step)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(max(0.0, STEP_TIME - (time.monotonic() - self.t0)))
        self.t0 = time.monotonic()


if __name__ == "__main__":
    main(["--steps", "1000000", "--save-steps", "10", *sys.argv[1:]], callbacks=[Pace()])
