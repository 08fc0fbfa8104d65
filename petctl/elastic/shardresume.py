"""Resuming a sharded job from the shards its nodes keep in memory (collective: every rank calls it).

1. Every rank offers the shard files its node holds for it (its own and the peer copy), each one's
   header, round and checksum checked first (`shardbundle.verify`: a torn, stale or damaged file is
   reported as `snapshot.skipped` and never offered).
2. The offers are all-gathered; rank 0 compares them with the store's newest step and picks the save
   (`shardselect.choose_shards`); the choice is broadcast.
3. Each old rank's shard is broadcast by the rank that holds it (re-read and re-verified first: a file that
   changed since the offer sends everyone to the store), so every rank holds the W shards of that save,
   puts each tensor together and takes its own slice of the new world (`shardcodec`).
4. One line says where the job resumed from: `snapshot.resume` (step, holders) or `snapshot.fallback`
   (why, and which old ranks' shards are gone: two neighbouring nodes lost at once), from rank 0.

Transient memory: every rank receives the whole state's shards once and puts the whole state together
from them (each shard freed as it is decoded), all freed when the load is done.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.core.eventlog import EventLog
from petctl.core.records import WireFormatError
from petctl.elastic.shardbundle import OWN, PEER, read_verified, shard_path, unpack
from petctl.elastic.shardcodec import assemble, load_into
from petctl.elastic.shardselect import ShardChoice, ShardOffer, choose_shards

# What a load of verified shards can still fail with: a skeleton refused or unreadable, a state that does
# not fit the live one (another model), a Stateful refusing it.
LOAD_FAILURES = (pickle.UnpicklingError, RuntimeError, ValueError, KeyError, TypeError, EOFError,
                 AttributeError, IndexError)


class ShardReader:
    """The shard files one rank holds (its node's directory, its local rank)."""

    def __init__(self, directory: Path, local_rank: int, rank: int, job: str, round_no: int,
                 log: EventLog) -> None:
        self.paths = {kind: shard_path(directory, kind, local_rank) for kind in (OWN, PEER)}
        self.rank, self.job, self.round, self.log = rank, job, round_no, log

    def offers(self) -> list[ShardOffer]:
        out = []
        for kind, path in self.paths.items():
            try:
                header, buf = read_verified(path, self.job, self.round)
            except FileNotFoundError:
                continue
            except (OSError, WireFormatError) as e:
                self.log.emit("snapshot.skipped", path=str(path), reason=str(e), round=self.round)
                continue
            out.append(ShardOffer(self.rank, header.rank, header.step, header.round, header.world_size,
                                  len(buf), kind))
        return out

    def load(self, offer: ShardOffer) -> bytearray:
        """The bytes of the file offered as `offer`, verified again. Raises OSError, WireFormatError
        (it changed since the offer)."""
        header, buf = read_verified(self.paths[offer.kind], self.job, self.round)
        if (header.rank, header.step, header.round, header.world_size, len(buf)) != (
                offer.old_rank, offer.step, offer.round, offer.world, offer.size):
            raise WireFormatError(f"shard file changed since it was offered (now step {header.step})")
        return buf


def resume_sharded(comm: Any, log: EventLog, reader: ShardReader | None, app_state: dict[str, Any],
                   store_step: Callable[[], int | None], weights_only: bool = True) -> int | None:
    """The step loaded into `app_state` from the shards in memory, or None to resume from the store.
    Collective; raises nothing a snapshot could cause (those are reported, and the store used)."""
    t0 = time.monotonic()
    mine = reader.offers() if reader is not None else []
    offers = [o for got in comm.all_gather_object(mine) for o in got]
    choice: ShardChoice | None = None
    if comm.is_writer:
        choice = choose_shards(offers, store_step() if offers else None)
    choice = comm.broadcast_object(choice)
    if choice.source != "snapshot":
        if comm.is_writer and (offers or reader is not None):  # snapshots on (not: a job without them)
            log.emit("snapshot.fallback", source=choice.source, missing=list(choice.missing),
                     reason=choice.reason, offers=len(offers))
        return None
    sent = _gather_shards(comm, reader, choice, offers)
    if sent is None:
        return _fell_back(comm, log, choice, "a holder could not read its shard again")
    failure = None
    try:  # the same bytes and code on every rank: they fail alike, and all fall back together
        full = assemble([unpack(sent.pop(old), weights_only) for old in range(len(choice.holders))])
        load_into(app_state, full)
    except LOAD_FAILURES as e:
        failure = f"{type(e).__name__}: {e}"
    if comm.any_true(failure is not None):
        return _fell_back(comm, log, choice, failure or "the load failed on another rank")
    if comm.is_writer:
        log.emit("snapshot.resume", source="snapshot", step=choice.step, round=choice.save[0],
                 world=choice.save[2], holders={old: rank for old, rank, _ in choice.holders},
                 missing=list(choice.missing), reason=choice.reason, seconds=round(time.monotonic() - t0, 3))
    return choice.step


def _gather_shards(comm: Any, reader: ShardReader | None, choice: ShardChoice,
                   offers: list[ShardOffer]) -> dict[int, bytearray] | None:
    """Old rank -> its shard's bytes, on every rank; None on every rank when a holder failed."""
    assert choice.save is not None
    mine: dict[int, bytearray] = {}
    failed = False
    for old, holder, _size in choice.holders:
        if holder != comm.rank:
            continue
        offer = next(o for o in offers if o.rank == holder and o.old_rank == old and o.save == choice.save)
        try:
            assert reader is not None
            mine[old] = reader.load(offer)
        except (OSError, WireFormatError) as e:
            reader.log.emit("snapshot.load_failed", step=choice.step, old_rank=old, error=str(e))
            failed = True
    if comm.any_true(failed):
        return None
    return {old: comm.broadcast_buffer(mine.get(old), size, src=holder)
            for old, holder, size in choice.holders}


def _fell_back(comm: Any, log: EventLog, choice: ShardChoice, why: str) -> None:
    if comm.is_writer:
        log.emit("snapshot.fallback", source="store", step=choice.step, missing=[], reason=why)
    return None


def store_newest(read: Callable[[], int | None], log: EventLog, url: str) -> Callable[[], int | None]:
    """`read` (the store's newest checkpoint step), called only when asked; None when the store cannot
    be read (reported: the snapshot may still be had)."""
    def newest() -> int | None:
        try:
            return read()
        except (OSError, ValueError) as e:
            log.emit("checkpoint.store_unreadable", error=repr(e), url=url)
            return None
    return newest
