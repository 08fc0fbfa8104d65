"""examples/lightning_ddp.py, unchanged, with the test's step ledger (tests/workloads/framework_ledger.py).

Run from the repository's PYTHONPATH (tests/support/cli.py): `examples` and `tests` import as packages.
`--step-time S` pads each step (tests/workloads/padding.py); every other argument is the example's.
"""

import sys

import lightning.pytorch as pl

from examples.lightning_ddp import main
from tests.workloads.framework_ledger import Ledger, take_step_time
from tests.workloads.padding import pad


class LedgerCallback(pl.Callback):
    def __init__(self, step_time: float) -> None:
        self.step_time = step_time
        self.ledger: Ledger | None = None

    def on_train_start(self, trainer, pl_module):
        self.ledger = Ledger(trainer.world_size) if trainer.global_rank == 0 else None
        if self.ledger:
            self.ledger.write("resumed", start=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.ledger:
            self.ledger.write("step", step=trainer.global_step - 1)
        pad(self.step_time)

    def on_train_end(self, trainer, pl_module):
        if self.ledger and trainer.global_step >= trainer.max_steps:
            self.ledger.write("done", step=trainer.global_step - 1)


if __name__ == "__main__":
    step_time, argv = take_step_time(sys.argv[1:])
    main(argv, callbacks=[LedgerCallback(step_time)])
