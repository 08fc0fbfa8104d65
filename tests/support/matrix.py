"""What the fault-matrix tests (tests/test_matrix_*.py) share: the ledger workload run through `petctl
run_job` on the local provider, fast failure detection, and reading rounds back from the node logs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.support.cli import Petctl
from tests.support.ledger import WORKLOAD, Ledger

# Fast failure detection (the defaults favour a LAN with real machines), as tests/e2e/test_local_jobs.py.
FAST = ["--timeout", "heartbeat_ttl=2", "--timeout", "last_call=0.5",
        "--timeout", "stop_grace=2", "--timeout", "imds_interval=0.5"]


def run_ledger_job(cli: Petctl, ledger_dir: Path, name: str, *options: str, **env: Any) -> None:
    """`petctl run_job` of the ledger workload; `env` becomes the workers' environment (--env)."""
    env_args = [arg for key, value in {"LEDGER_DIR": ledger_dir, **env}.items()
                for arg in ("--env", f"{key}={value}")]
    cli.run("run_job", "--name", name, *FAST, *env_args, *options, str(WORKLOAD))


def wait_until(predicate, timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(every)


def ledger_steps(ledger_dir: Path, world: int | None = None) -> int:
    """How many steps the ledger holds (at world size `world`, when given)."""
    return sum(1 for e in Ledger.read(ledger_dir).of("step") if world is None or e["world"] == world)


def final_rounds(cli: Petctl, job: str) -> dict[str, dict[str, Any]]:
    """Each node's last `rendezvous.complete` (its final round, rank and world size)."""
    last: dict[str, dict[str, Any]] = {}
    for e in cli.events(job, "rendezvous.complete"):
        last[e["node"]] = e
    return last

