"""Reading the step ledger of tests/workloads/user_train.py (a user's script), and its uninterrupted replay.

Lost work is a step rank 0 completed more than once: in one round, then again in a later round that
resumed from an older checkpoint. The ledger is the script's own record of its steps, not petctl's events,
so it shows what a user would see.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.ledger import read_jsonl
from tests.support.paths import REPO, WORKLOADS
from tests.workloads.padding import SLOWED, UNPADDED

USER_SCRIPT = WORKLOADS / "user_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def replay(*script_args: str) -> tuple[float, ...]:
    """The final weights of an uninterrupted run of the user's script (one process, world 1, no pause).

    Raises AssertionError (with the script's output) when that run fails."""
    with tempfile.TemporaryDirectory(prefix="petctl-replay-") as tmp:
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "LEDGER_DIR": tmp,
               "PETCTL_CHECKPOINT_URL": Path(tmp, "checkpoints").as_uri(),
               "PETCTL_CACHE_DIR": str(Path(tmp, "cache")),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        for key in ("PETCTL_CONTROL_DIR", "PETCTL_ROUND", "PETCTL_NODE_ID"):
            env.pop(key, None)
        proc = subprocess.run([sys.executable, str(USER_SCRIPT), *script_args, "--step-time", "0"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"the replay failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        ledger = UserLedger.read(Path(tmp))
        assert ledger.redone() == {} and [r["world"] for r in ledger.of("resumed")] == [1], ledger.entries[:3]
        return tuple(ledger.final_weights())


def slow_padding(ledger_dir: Path) -> None:
    """From now on the job's padded steps take SLOWED_STEP (tests/workloads/padding.py): call it the moment
    the test has found the step it acts at, before the CLI calls that deliver the action."""
    (ledger_dir / SLOWED).touch()


def end_padding(ledger_dir: Path) -> None:
    """From now on the job's steps go unpadded (tests/workloads/padding.py): call it once the test has seen,
    at the padded step, everything it asserts on that depends on the step's time."""
    (ledger_dir / UNPADDED).touch()


@dataclass
class UserLedger:
    entries: list[dict[str, Any]]

    @classmethod
    def read(cls, directory: Path) -> UserLedger:
        """Every line of `directory/ledger.jsonl` in order; a line cut short by a killed writer is skipped."""
        return cls(read_jsonl(directory / "ledger.jsonl"))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["event"] == event]

    def last_step(self, world: int | None = None) -> int | None:
        steps = [e["step"] for e in self.of("step") if world is None or e["world"] == world]
        return steps[-1] if steps else None

    def redone(self) -> dict[int, list[int]]:
        """step -> the rounds that computed it, for every step computed more than once (lost work)."""
        rounds: dict[int, list[int]] = {}
        for e in self.of("step"):
            rounds.setdefault(e["step"], []).append(e["round"])
        return {step: r for step, r in sorted(rounds.items()) if len(r) > 1}

    def missing(self, steps: int) -> list[int]:
        return sorted(set(range(steps)) - {e["step"] for e in self.of("step")})

    def training_rounds(self) -> list[tuple[int, int, int, int]]:
        """(round, world, first step, last step) of each round in which rank 0 completed a step, in order."""
        out: dict[int, tuple[int, int, int, int]] = {}
        for e in self.of("step"):
            rnd, world, first, _ = out.get(e["round"], (e["round"], e["world"], e["step"], e["step"]))
            out[e["round"]] = (rnd, world, first, e["step"])
        return list(out.values())

    def worlds(self) -> list[int]:
        return [world for _, world, _, _ in self.training_rounds()]

    def final_weights(self) -> list[float]:
        (done,) = self.of("done")
        return done["weights"]

    def story(self) -> str:
        """One line per training round: what it ran, and how it ended (saved and left, or not)."""
        left = {e["round"]: e["step"] for e in self.of("left")}
        return "; ".join(f"round {rnd} (world {world}): steps {first}-{last}"
                         + (f", saved and left at {left[rnd]}" if rnd in left else "")
                         for rnd, world, first, last in self.training_rounds())

    def describe_redone(self) -> str:
        """'12 steps redone: 40-51 in rounds [1, 2]; rounds: ...' (runs redone by the same rounds)."""
        redone = self.redone()
        runs: list[list[Any]] = []  # [first, last, rounds]
        for step, rounds in redone.items():
            if runs and runs[-1][1] == step - 1 and runs[-1][2] == rounds:
                runs[-1][1] = step
            else:
                runs.append([step, step, rounds])
        spans = ", ".join(f"{a}-{b} in rounds {r}" if a != b else f"{a} in rounds {r}" for a, b, r in runs)
        return f"{len(redone)} steps redone: {spans}; rounds: {self.story()}"
