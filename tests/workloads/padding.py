"""The padding the test workloads add to each step (`--step-time S`: a slower model's step) and to a
throttled upload (a slower store), which a test may end once it has seen what it asserts on: from the
moment `$LEDGER_DIR/unpadded` exists, nothing is padded. A drill that kills a node at a padded step waits
for the survivors' first step, then lets the rest of the run (steps that only have to be done, and done
right) go at the model's own speed. tests/workloads/steps.py, which imports nothing of the repository,
reads the same file.

A test that acts at a chosen step (a notice or a scale 5-9 steps past a checkpoint) slows the steps first:
while `$LEDGER_DIR/slowed` exists each step is padded to SLOWED_STEP, so the CLI calls that deliver the
action (a second or more on a loaded machine, 20 steps or more at 0.05 s) cost a few steps, and the
action still lands before the next periodic checkpoint.
"""

import os
import time

UNPADDED = "unpadded"
SLOWED = "slowed"
SLOWED_STEP = 0.5


def padding_ended() -> bool:
    """Whether the test has ended the padding (`$LEDGER_DIR/unpadded` exists)."""
    directory = os.environ.get("LEDGER_DIR")
    return bool(directory) and os.path.exists(os.path.join(directory, UNPADDED))


def pad(step_time: float) -> None:
    """Sleep `step_time` seconds (SLOWED_STEP while the test slows the steps), unless the test has ended
    the padding."""
    directory = os.environ.get("LEDGER_DIR")
    if step_time <= 0 or padding_ended():
        return
    time.sleep(SLOWED_STEP if directory and os.path.exists(os.path.join(directory, SLOWED)) else step_time)


def wait_padded(seconds: float) -> None:
    """Sleep `seconds` (a slow store's time, which slowing the steps does not change), unless the test has
    ended the padding, then return at once."""
    end = time.time() + seconds
    while (now := time.time()) < end:
        if padding_ended():
            return
        time.sleep(min(0.1, end - now))
