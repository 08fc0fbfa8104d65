"""Reading the step ledger that tests/workloads/ledger_train.py writes, and checking it against a replay.

What the fault-matrix tests assert with it:
- every step any rank ran left the weights exactly where a single-process replay has them after that
  step (so each round resumed from a correct, complete state and applied each step once);
- the final weights are the replay's, bit for bit;
- per round: who ran it with which rank, where it resumed, how far it got; between rounds, how many steps
  were run and then thrown away (redone after a resume from an older checkpoint).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.paths import WORKLOADS

WORKLOAD = WORKLOADS / "ledger_train.py"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of `path` in order (none when it does not exist); a line a killed writer cut short
    (no newline yet, or not JSON) is skipped."""
    text = path.read_text() if path.exists() else ""
    entries = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            continue
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return entries


@functools.cache
def _workload() -> Any:
    spec = importlib.util.spec_from_file_location("ledger_train", WORKLOAD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def replay(steps: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(digest of the weights after each step, the final weights as float.hex) from one process."""
    digests, weights = _workload().replay(steps)
    return tuple(digests), tuple(weights)


@dataclass
class RoundRun:
    """What the ledger says about one round (PETCTL_ROUND)."""

    round: int
    ranks: dict[str, int] = field(default_factory=dict)  # node -> rank
    worlds: set[int] = field(default_factory=set)
    loaded: set[int | None] = field(default_factory=set)  # the checkpoint step each rank resumed from
    steps: dict[str, list[int]] = field(default_factory=dict)  # node -> steps it ran, in order

    @property
    def first(self) -> int | None:
        return min((s[0] for s in self.steps.values() if s), default=None)

    @property
    def last(self) -> int | None:
        """The last step every rank of the round completed (what a checkpoint of it could hold)."""
        ends = [s[-1] for s in self.steps.values() if s]
        return min(ends) if ends and len(ends) == len(self.ranks) else None


@dataclass
class Ledger:
    entries: list[dict[str, Any]]

    @classmethod
    def read(cls, directory: Path) -> Ledger:
        """Every ledger line of every rank, oldest first; a line cut by a SIGKILL is skipped."""
        entries = [e for path in sorted(directory.glob("*.jsonl")) for e in read_jsonl(path)]
        return cls(sorted(entries, key=lambda e: e["ts"]))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["event"] == event]

    def rounds(self) -> dict[int, RoundRun]:
        out: dict[int, RoundRun] = {}
        for e in self.entries:
            run = out.setdefault(e["round"], RoundRun(e["round"]))
            run.ranks[e["node"]] = e["rank"]
            run.worlds.add(e["world"])
            if e["event"] == "resumed":
                run.loaded.add(e["loaded"])
            elif e["event"] == "step":
                run.steps.setdefault(e["node"], []).append(e["step"])
        return dict(sorted(out.items()))

    def training_rounds(self) -> list[RoundRun]:
        """Rounds in which at least one step was run, in order."""
        return [r for r in self.rounds().values() if r.first is not None]

    def assert_exact(self, steps: int, final: Path | None = None) -> None:
        """Each step's weights are the replay's; so are the final ones (when `final` is given)."""
        digests, weights = replay(steps)
        wrong = [(e["node"], e["round"], e["step"]) for e in self.of("step")
                 if e["digest"] != digests[e["step"]]]
        assert not wrong, f"steps whose weights differ from the replay (node, round, step): {wrong[:10]}"
        for run in self.rounds().values():
            for node, ran in run.steps.items():
                assert ran == list(range(ran[0], ran[0] + len(ran))), f"round {run.round} {node}: {ran}"
                assert len(run.loaded) == 1, f"round {run.round}: ranks resumed from {run.loaded}"
                (loaded,) = run.loaded
                assert ran[0] == (-1 if loaded is None else loaded) + 1, (run.round, node, loaded, ran[:3])
        if final is not None:
            data = json.loads(final.read_text())
            assert data["steps"] == steps and tuple(data["weights"]) == weights, "final weights differ"

    def redone(self) -> list[int]:
        """Per restart, how many steps of the round before were run and then thrown away."""
        runs = self.training_rounds()
        out = []
        for before, after in zip(runs, runs[1:], strict=False):
            (loaded,) = after.loaded
            last = max(s[-1] for s in before.steps.values())
            out.append(max(0, last - (-1 if loaded is None else loaded)))
        return out


def manifests(checkpoints: Path) -> list[int]:
    """Steps with a manifest in a file:// checkpoint store (complete checkpoints), oldest first."""
    return sorted(int(p.stem.split("-")[1]) for p in checkpoints.glob("manifest-*.json"))


def data_steps(checkpoints: Path) -> list[int]:
    """Steps with a data directory (complete, or an upload cut off), oldest first."""
    return sorted(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*") if p.is_dir())
