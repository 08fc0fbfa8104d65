"""Which sharded snapshot a re-formed job resumes from: a pure function over what every rank offers.

A sharded save is one file per old rank (its DCP shard, `shardbundle`), written by that rank into its own
node's memory and copied to the next node's (`shardsnap`). On a resume every rank offers the shard files
it holds, own and peer copies, each naming its save (the round that wrote it, its step, its world size)
and the old rank whose shard it is. A save can be loaded only when the shards of every old rank
0..W-1 are held by some live rank; the job takes the newest such save (by round, then step) unless the
store's newest checkpoint is newer. When the newest save lacks shards (two neighbouring nodes lost at
once: a shard and its only copy went together) the choice says which old ranks are missing, so the
fallback to the store is reported with its cause.

No torch, no I/O: `tests/test_shard_snapshots.py` checks it as a table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardOffer:
    """Rank `rank` holds a verified shard file: old rank `old_rank`'s shard of the save of `step`,
    written in round `round` by a job of `world` ranks; `size` bytes (header included)."""

    rank: int
    old_rank: int
    step: int
    round: int
    world: int
    size: int
    kind: str = "own"  # "own" (this node's rank wrote it) or "peer" (a copy sent by the previous node)

    @property
    def save(self) -> tuple[int, int, int]:
        return self.round, self.step, self.world


@dataclass(frozen=True)
class ShardChoice:
    """Where the job resumes from.

    source: "snapshot", "store" or "none" (nothing anywhere).
    save: (round, step, world) of the snapshot taken; holders: old rank -> (new rank that sends it,
        bytes), for every old rank 0..world-1.
    missing: the old ranks of the newest save that no live rank holds (empty unless that is why the
        snapshot was passed over).
    """

    source: str
    save: tuple[int, int, int] | None = None
    holders: tuple[tuple[int, int, int], ...] = ()
    missing: tuple[int, ...] = ()
    reason: str = ""

    @property
    def step(self) -> int | None:
        return None if self.save is None else self.save[1]


def choose_shards(offers: Iterable[ShardOffer], store_step: int | None = None) -> ShardChoice:
    """The newest save whose every shard some rank holds, unless the store is newer (see the module).
    A tie with the store goes to memory (no download). Offers whose old rank is outside their world
    (a damaged header) are ignored."""
    by_save: dict[tuple[int, int, int], dict[int, ShardOffer]] = {}
    for offer in offers:
        if not 0 <= offer.old_rank < offer.world:
            continue
        held = by_save.setdefault(offer.save, {})
        best = held.get(offer.old_rank)
        if best is None or offer.rank < best.rank:
            held[offer.old_rank] = offer
    if not by_save:
        return _fallback(store_step, "no rank offered a shard snapshot")
    complete = [s for s, held in by_save.items() if len(held) == s[2]]
    newest = max(by_save)
    missing = tuple(sorted(set(range(newest[2])) - by_save[newest].keys()))
    best = max(complete, default=None)
    if best is None:
        why = (f"the shards of old ranks {list(missing)} of step {newest[1]} are held by no live rank "
               "(a node and the next one, which kept its copy, lost at once)")
        return _fallback(store_step, why, missing)
    step = best[1]
    if store_step is not None and store_step > step:
        return _fallback(store_step, f"store step {store_step} is newer than the snapshot of step {step}")
    held = by_save[best]
    holders = tuple((old, held[old].rank, held[old].size) for old in range(best[2]))
    why = f"snapshot of step {step}"
    if store_step is not None:
        why += f", {step - store_step} step(s) newer than the store's {store_step}"
    if best != newest:
        why += f"; the newer step {newest[1]} lacks old ranks {list(missing)}"
    return ShardChoice("snapshot", best, holders, () if best == newest else missing, why)


def _fallback(store_step: int | None, reason: str, missing: tuple[int, ...] = ()) -> ShardChoice:
    return ShardChoice("store" if store_step is not None else "none", missing=missing, reason=reason)
