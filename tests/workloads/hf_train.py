"""examples/hf_trainer.py, unchanged, with the test's step ledger (tests/workloads/framework_ledger.py).

Run from the repository's PYTHONPATH (tests/support/cli.py): `examples` and `tests` import as packages.
`--step-time S` pads each step (tests/workloads/padding.py); every other argument is the example's.
"""

import os
import sys

from transformers import TrainerCallback

from examples.hf_trainer import main
from tests.workloads.framework_ledger import Ledger, take_step_time
from tests.workloads.padding import pad


class LedgerCallback(TrainerCallback):
    def __init__(self, step_time: float) -> None:
        self.ledger = Ledger(int(os.environ.get("WORLD_SIZE", "1")))
        self.step_time = step_time
        self.rank0 = int(os.environ.get("RANK", "0")) == 0

    def on_train_begin(self, args, state, control, **kwargs):
        if self.rank0:
            self.ledger.write("resumed", start=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.rank0:
            self.ledger.write("step", step=state.global_step - 1)
        pad(self.step_time)

    def on_train_end(self, args, state, control, **kwargs):
        if self.rank0 and state.global_step >= state.max_steps:
            self.ledger.write("done", step=state.global_step - 1)


if __name__ == "__main__":
    step_time, argv = take_step_time(sys.argv[1:])
    main(argv, callbacks=[LedgerCallback(step_time)])
