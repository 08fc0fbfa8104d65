"""Where things are in the checkout, for tests that run scripts by path or put the repository on a
subprocess's PYTHONPATH: one definition, so a moved directory breaks one line, not thirty."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
EXAMPLES = REPO / "examples"
WORKLOADS = TESTS / "workloads"  # the scripts the tests run as users' jobs
SUPPORT = TESTS / "support"  # helpers, some run by path (netns_agent.py)
