"""The step ledger the framework examples are tested with, as a callback of the script's own.

tests/workloads/hf_train.py and lightning_train.py run examples/hf_trainer.py and examples/lightning_ddp.py
unchanged, adding one callback each: rank 0 appends one JSON line per completed step to
`$LEDGER_DIR/ledger.jsonl` (read by tests/support/userledger.py),
`{"event": "step", "step": i, "round", "world", "node", "ts"}` with i = global_step - 1 (0-based),
`resumed` when training starts, and `done` once training ends at its last step. `--step-time S` pads each
step (a slower model): the workloads take it off the command line before the example parses the rest.
"""

import json
import os
import time


class Ledger:
    def __init__(self, world: int) -> None:
        directory = os.environ.get("LEDGER_DIR")
        self.path = os.path.join(directory, "ledger.jsonl") if directory else None
        self.world = world

    def write(self, event: str, **fields) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"ts": time.time(), "event": event, "world": self.world,
                                    "round": int(os.environ.get("PETCTL_ROUND", "0")),
                                    "node": os.environ.get("PETCTL_NODE_ID", ""), **fields}) + "\n")


def take_step_time(argv: list[str]) -> tuple[float, list[str]]:
    """(--step-time's value, the other arguments)."""
    if "--step-time" not in argv:
        return 0.0, argv
    i = argv.index("--step-time")
    return float(argv[i + 1]), argv[:i] + argv[i + 2:]
