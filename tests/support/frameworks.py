"""The framework jobs' settings (tests/workloads/hf_train.py and lightning_train.py, run through `petctl
run_job` by the issue 15 and issue 25 tests): the same periodic checkpoint and step time in each, so a
"mid-way between two checkpoints" means the same steps everywhere."""

from __future__ import annotations

SAVE_EVERY = 20  # the framework's own periodic checkpoint (--save-steps)
STEP_TIME = 0.05  # seconds each step takes at least (--step-time)
