"""Reading the sample ledger of tests/workloads/data_ledger.py: which steps a later round redid, and
whether the steps that were kept read every sample of every epoch exactly once.

A round that starts at step s (its `resumed` line) redoes every step >= s that an earlier round recorded:
those records are `redone`, the newest record of each step is `kept`. The kept steps, in step order, each
put back in the order of its global positions (`positions`), are the job's stream of samples: epoch e is
its samples e * size ... (e + 1) * size - 1. Nothing here knows how petctl's sampler works: only the
dataset's size and what the script saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.ledger import read_jsonl


def positions(record: dict[str, Any]) -> list[int]:
    """A step's samples in the order of its global positions: rank r's i-th sample is position r + i * W."""
    ranks, world = record["ranks"], record["world"]
    per_rank = {len(r) for r in ranks}
    assert len(per_rank) == 1 and len(ranks) == world, f"ranks read unequal shares: {record}"
    (count,) = per_rank
    return [ranks[p % world][p // world] for p in range(count * world)]


@dataclass
class DataLedger:
    entries: list[dict[str, Any]]

    @classmethod
    def read(cls, directory: Path) -> DataLedger:
        """Every line rank 0 wrote; one a kill cut short is skipped (as every ledger reader does)."""
        return cls(read_jsonl(directory / "ledger.jsonl"))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["event"] == event]

    def last_step(self, world: int | None = None) -> int | None:
        steps = [e["step"] for e in self.of("step") if world is None or e["world"] == world]
        return max(steps) if steps else None

    def split(self) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
        """(the kept record of each step, the records later rounds redid), in the ledger's order."""
        kept: dict[int, dict[str, Any]] = {}
        redone: list[dict[str, Any]] = []
        for e in self.entries:
            if e["event"] == "resumed":
                redone += [kept.pop(s) for s in sorted(kept) if s >= e["start"]]
            elif e["event"] == "step":
                assert e["step"] not in kept, f"step {e['step']} twice in one round: {e}"
                kept[e["step"]] = e
        return kept, redone

    def stream(self) -> list[int]:
        """The kept steps' samples, in step order, each step in position order."""
        kept, _ = self.split()
        missing = sorted(set(range(max(kept, default=-1) + 1)) - set(kept))
        assert not missing, f"steps never recorded: {missing}"
        return [i for s in sorted(kept) for i in positions(kept[s])]

    def story(self) -> str:
        """The rounds, for assertion messages: (round, world, first step, last step)."""
        rounds: dict[int, list[dict[str, Any]]] = {}
        for e in self.of("step"):
            rounds.setdefault(e["round"], []).append(e)
        return "; ".join(f"round {r}: world {es[0]['world']}, steps {es[0]['step']}-{es[-1]['step']}"
                         for r, es in sorted(rounds.items()))


def epoch_problems(stream: list[int], size: int) -> list[str]:
    """Every whole epoch of the stream must be a permutation of range(size); the last, partial one must
    repeat nothing. Returns what is wrong (empty: exactly once)."""
    problems = []
    for start in range(0, len(stream), size):
        epoch = stream[start:start + size]
        if len(epoch) == size and sorted(epoch) != list(range(size)):
            missing = sorted(set(range(size)) - set(epoch))
            twice = sorted({i for i in epoch if epoch.count(i) > 1})
            problems.append(f"epoch {start // size}: missing {missing}, twice {twice}")
        elif len(epoch) < size and len(set(epoch)) != len(epoch):
            problems.append(f"epoch {start // size} (partial): repeats {sorted(epoch)}")
    return problems
