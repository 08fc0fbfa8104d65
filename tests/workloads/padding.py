"""The padding the test workloads add to each step (`--step-time S`: a slower model's step) and to a
throttled upload (a slower store), which a test may end once it has seen what it asserts on: from the
moment `$LEDGER_DIR/unpadded` exists, nothing is padded. A drill that kills a node at a padded step waits
for the survivors' first step, then lets the rest of the run (steps that only have to be done, and done
right) go at the model's own speed. tests/workloads/steps.py, which imports nothing of the repository,
reads the same file.
"""

import os
import time

UNPADDED = "unpadded"


def pad(step_time: float) -> None:
    """Sleep `step_time` seconds, unless the test has ended the padding."""
    directory = os.environ.get("LEDGER_DIR")
    if step_time > 0 and not (directory and os.path.exists(os.path.join(directory, UNPADDED))):
        time.sleep(step_time)
