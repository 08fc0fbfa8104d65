"""Which step a re-formed job resumes from, and from where: a pure function over what every rank offers.

On a resume every rank says what it holds: a valid in-memory snapshot (its step, and which parts of the
state it covers), and rank 0 also the newest step in the durable store. The job resumes from the newest
step at which the offers together cover every part of the state; the store wins only when it is newer
than every such step (a tie goes to memory: no download). Under DDP the state is one part (every rank
holds all of it), so any one snapshot covers a step; a sharded state has one part per shard, and a step
is covered only when every shard is held by some rank (its own snapshot or a peer's copy of it).

No torch, no I/O: `tests/test_snapshots.py` checks it as a table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

WHOLE = frozenset({0})  # the one part of a replicated (DDP) state


@dataclass(frozen=True)
class Offer:
    """A snapshot rank `rank` can load and send: the state after `step`, parts `covers`."""

    rank: int
    step: int
    covers: frozenset[int] = WHOLE


@dataclass(frozen=True)
class Choice:
    """Where the job resumes from.

    source: "snapshot" (from the ranks in `holders`), "store" (the durable tier: its newest checkpoint),
        or "none" (nothing anywhere: a fresh start).
    step: the step whose state is loaded (None for "store", where the store's loader decides, and "none").
    holders: part -> the rank that sends it (the lowest rank holding it at `step`).
    """

    source: str
    step: int | None = None
    holders: tuple[tuple[int, int], ...] = ()
    reason: str = ""

    @property
    def holder_of(self) -> dict[int, int]:
        return dict(self.holders)


def newest_common(offers: Iterable[Offer], parts: frozenset[int] = WHOLE,
                  store_step: int | None = None) -> Choice:
    """The newest step the offers cover completely, unless the store holds a newer one (see the module).

    `store_step`: the store's newest checkpoint (None: none, or the store could not be read)."""
    by_step: dict[int, dict[int, int]] = {}
    for offer in offers:
        holders = by_step.setdefault(offer.step, {})
        for part in offer.covers & parts:
            holders[part] = min(holders.get(part, offer.rank), offer.rank)
    covered = [s for s, holders in by_step.items() if parts <= holders.keys()]
    best = max(covered, default=None)
    if best is not None and (store_step is None or best >= store_step):
        holders = by_step[best]
        return Choice("snapshot", best, tuple(sorted((p, holders[p]) for p in parts)),
                      reason=_why_snapshot(best, store_step))
    if store_step is not None:
        why = (f"store step {store_step} is newer than every snapshot" if best is not None else
               _why_no_snapshot(by_step, parts))
        return Choice("store", None, reason=why)
    return Choice("none", reason=_why_no_snapshot(by_step, parts))


def _why_snapshot(best: int, store_step: int | None) -> str:
    if store_step is None:
        return f"snapshot of step {best}; the store has none"
    return f"snapshot of step {best} is {best - store_step} step(s) newer than the store's {store_step}"


def _why_no_snapshot(by_step: dict[int, dict[int, int]], parts: frozenset[int]) -> str:
    if not by_step:
        return "no rank offered a snapshot"
    newest = max(by_step)
    missing = sorted(parts - by_step[newest].keys())
    return f"no step is covered by the snapshots (step {newest} lacks parts {missing})"
