"""Resuming from the in-memory tier, replicated and sharded side by side: what a rank offers (`Offer`,
`ShardOffer`), which save the job takes (`newest_common`, `choose_shards`: pure functions over the offers),
and how it travels back into the state (`resume_from_snapshot`, `resume_sharded`).
"""

from __future__ import annotations

import mmap
import pickle
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import HEADER_SIZE, SnapshotHeader, stale_reason
from petctl.elastic.snapshots.codec import (
    SHARD_KINDS,
    assemble,
    decode,
    load_into,
    payload_checksum,
    read_verified,
    shard_path,
    unpack,
)
from petctl.io.eventlog import EventLog
from petctl.io.snapshotfiles import read_header

# --- the replicated choice ----------------------------------------------------------------------------------
# Which step a re-formed job resumes from, and from where: a pure function over what every rank offers.
#
# On a resume every rank says what it holds: a valid in-memory snapshot (its step, and which parts of the
# state it covers), and rank 0 also the newest step in the durable store. The job resumes from the newest
# step at which the offers together cover every part of the state; the store wins only when it is newer
# than every such step (a tie goes to memory: no download). Under DDP the state is one part (every rank
# holds all of it), so any one snapshot covers a step; a sharded state has one part per shard, and a step
# is covered only when every shard is held by some rank (its own snapshot or a peer's copy of it).
#
# No torch, no I/O: `tests/elastic/test_snapshots.py` checks it as a table.


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
    passed_over: the newest step the snapshots cover, when the store was newer and won (else None).
    """

    source: str
    step: int | None = None
    holders: tuple[tuple[int, int], ...] = ()
    reason: str = ""
    passed_over: int | None = None

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
        return Choice("store", None, reason=why, passed_over=best)
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



# --- the sharded choice -------------------------------------------------------------------------------------
# Which sharded snapshot a re-formed job resumes from: a pure function over what every rank offers.
#
# A sharded save is one file per old rank (its DCP shard, `codec`), written by that rank into its own
# node's memory and copied to the next node's (`ring`). On a resume every rank offers the shard files
# it holds, own and peer copies, each naming its save (the round that wrote it, its step, its world size)
# and the old rank whose shard it is. A save can be loaded only when the shards of every old rank
# 0..W-1 are held by some live rank; the job takes the newest such save (by round, then step) unless the
# store's newest checkpoint is newer. When the newest save lacks shards (two neighbouring nodes lost at
# once: a shard and its only copy went together) the choice says which old ranks are missing, so the
# fallback to the store is reported with its cause.
#
# No torch, no I/O: `tests/elastic/test_sharded_snapshots.py` checks it as a table.


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
    # codec.SHARD_KINDS: "own" (this node's rank wrote it), "peer" (a copy sent by the previous node), or
    # either's "-before": the save before the newest, kept while the ranks commit the newest
    kind: str = "own"

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
    passed_over: the step of the newest whole save, when the store was newer and won (else None).
    store_step: the store's newest step as the choice read it (None: none, or not asked).
    """

    source: str
    save: tuple[int, int, int] | None = None
    holders: tuple[tuple[int, int, int], ...] = ()
    missing: tuple[int, ...] = ()
    reason: str = ""
    passed_over: int | None = None
    store_step: int | None = None

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
        why = f"store step {store_step} is newer than the snapshot of step {step}"
        return ShardChoice("store", reason=why, passed_over=step, store_step=store_step)
    held = by_save[best]
    holders = tuple((old, held[old].rank, held[old].size) for old in range(best[2]))
    why = f"snapshot of step {step}"
    if store_step is not None:
        why += f", {step - store_step} step(s) newer than the store's {store_step}"
    if best != newest:
        why += f"; the newer step {newest[1]} lacks old ranks {list(missing)}"
    return ShardChoice("snapshot", best, holders, () if best == newest else missing, why,
                       store_step=store_step)


def _fallback(store_step: int | None, reason: str, missing: tuple[int, ...] = ()) -> ShardChoice:
    return ShardChoice("store" if store_step is not None else "none", missing=missing, reason=reason,
                       store_step=store_step)



# --- the replicated resume ----------------------------------------------------------------------------------
# Resuming from an in-memory snapshot: what a rank offers, which one the job takes, how it travels.
#
# On a resume every rank says which snapshot it holds (`SnapshotReader.offer`: only local rank 0 of a node
# has one, and only after its header, its round and its checksum checked out); the offers are all-gathered
# (one small collective, on every rank, whether or not it holds anything, so ranks never disagree on the
# protocol); rank 0 compares them with the store's newest step and says what the job takes
# (`resume.newest_common`); the holder reads its payload and broadcasts it, as today's resume
# broadcasts rank 0's download; every rank decodes it. When no snapshot qualifies, or the holder cannot read
# it after all, the caller falls back to the store.


class SnapshotReader:
    """The snapshot file of this node, as a resume sees it; torn, stale or damaged ones are reported
    (`snapshot.skipped`, with why) and never offered."""

    def __init__(self, path: Path, job: str, round_no: int, rank: int, log: EventLog) -> None:
        self.path, self.job, self.round, self.rank, self.log = path, job, round_no, rank, log
        self.header: SnapshotHeader | None = None  # the header of the snapshot offered

    def offer(self) -> Offer | None:
        """This rank's offer: the step of a valid snapshot here, or None."""
        self.header = None
        try:
            header = read_header(self.path)
        except FileNotFoundError:
            return None
        except (OSError, WireFormatError) as e:
            return self._skip(None, str(e))
        stale = stale_reason(header, self.job, self.round)
        if stale is not None:
            return self._skip(header, f"stale: {stale}")
        try:
            size = HEADER_SIZE + header.payload_length  # copy-on-write: a buffer torch takes, unwritten
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
                crc = payload_checksum(mm, HEADER_SIZE, header.payload_length)
        except (OSError, ValueError) as e:
            return self._skip(header, f"unreadable: {e}")
        if crc != header.checksum:
            return self._skip(header, "checksum mismatch (the payload changed after its commit)")
        self.header = header
        return Offer(self.rank, header.step)

    def _skip(self, header: SnapshotHeader | None, reason: str) -> None:
        self.log.emit("snapshot.skipped", path=str(self.path), reason=reason,
                      step=header.step if header else None, round=self.round,
                      written_round=header.round if header else None)
        return None

    def load(self, step: int) -> tuple[bytearray, SnapshotHeader]:
        """The payload of the snapshot offered (a private copy), when it still holds `step`. Raises
        OSError when the file cannot be read, WireFormatError when it changed since the offer."""
        header = read_header(self.path)
        if self.header is None or header != self.header or header.step != step:
            raise WireFormatError(f"snapshot changed since it was offered (now {header.step}, wanted {step})")
        payload = bytearray(header.payload_length)
        with open(self.path, "rb") as f:
            f.seek(HEADER_SIZE)
            if f.readinto(payload) != len(payload):
                raise WireFormatError("snapshot file shorter than its header says")
        return payload, header


def resume_from_snapshot(comm: Any, log: EventLog, reader: SnapshotReader | None,
                         store_step: Callable[[], int | None],
                         weights_only: bool = True) -> tuple[int, dict[str, Any]] | None:
    """(step, state) from the newest snapshot any rank holds when it is at least as new as the store's
    newest checkpoint; None to resume from the store. Collective: every rank calls it. Raises
    nothing: a snapshot that cannot be read or decoded is reported and the store used instead."""
    t0 = time.monotonic()
    mine = reader.offer() if reader is not None else None
    offers = [o for o in comm.all_gather_object(mine) if o is not None]
    if not offers:
        return None
    store_step_read = store_step() if comm.is_writer else None
    choice = newest_common(offers, store_step=store_step_read) if comm.is_writer else None
    choice = comm.broadcast_object(choice)
    if choice.source != "snapshot":
        if comm.is_writer:
            log.emit("snapshot.passed_over", reason=choice.reason, offers=len(offers),
                     snapshot_step=choice.passed_over, store_step=store_step_read)
        return None
    holder = choice.holder_of[0]
    info: tuple[Any, ...] | None = None
    payload: bytearray | None = None
    if comm.rank == holder:
        assert reader is not None
        try:
            payload, header = reader.load(choice.step)
            info = ("ok", header.data_length, header.meta_offset, header.meta_length)
        except (OSError, WireFormatError) as e:
            info = ("error", f"{type(e).__name__}: {e}")
    info = comm.broadcast_object(info, src=holder)
    if info[0] != "ok":
        log.emit("snapshot.load_failed", step=choice.step, holder=holder, error=info[1])
        return None
    _ok, data_length, meta_offset, meta_length = info
    payload = comm.broadcast_buffer(payload, meta_offset + meta_length, src=holder)
    try:  # the same bytes and code on every rank: they all fail alike, and all fall back together
        state = decode(payload, data_length, meta_offset, meta_length, weights_only)
    except (pickle.UnpicklingError, ValueError, EOFError, KeyError, TypeError) as e:
        log.emit("snapshot.load_failed", step=choice.step, holder=holder, error=f"{type(e).__name__}: {e}")
        return None
    log.emit("checkpoint.loaded", step=choice.step, source="snapshot", holder=holder, bytes=len(payload),
             seconds=round(time.monotonic() - t0, 3), reason=choice.reason)
    return choice.step, state



# --- the sharded resume -------------------------------------------------------------------------------------
# Resuming a sharded job from the shards its nodes keep in memory (collective: every rank calls it).
#
# 1. Every rank offers the shard files its node holds for it (its own and the peer copy), each one's
#    header, round and checksum checked first (`codec.verify`: a torn, stale or damaged file is
#    reported as `snapshot.skipped` and never offered).
# 2. The offers are all-gathered; rank 0 compares them with the store's newest step and picks the save
#    (`resume.choose_shards`); the choice is broadcast.
# 3. Each old rank's shard is broadcast by the rank that holds it (re-read and re-verified first: a file that
#    changed since the offer sends everyone to the store), so every rank holds the W shards of that save,
#    puts each tensor together and takes its own slice of the new world (`codec`).
# 4. One line says where the job resumed from: `snapshot.resume` (step, holders) or `snapshot.fallback`
#    (why, and which old ranks' shards are gone: two neighbouring nodes lost at once), from rank 0.
#
# Transient memory: every rank receives the whole state's shards once and puts the whole state together
# from them (each shard freed as it is decoded), all freed when the load is done.


# What a load of verified shards can still fail with: a skeleton refused or unreadable, a state that does
# not fit the live one (another model), a Stateful refusing it.
LOAD_FAILURES = (pickle.UnpicklingError, RuntimeError, ValueError, KeyError, TypeError, EOFError,
                 AttributeError, IndexError)


class ShardReader:
    """The shard files one rank holds (its node's directory, its local rank)."""

    def __init__(self, directory: Path, local_rank: int, rank: int, job: str, round_no: int,
                 log: EventLog) -> None:
        self.paths = {kind: shard_path(directory, kind, local_rank) for kind in SHARD_KINDS}
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
                     reason=choice.reason, offers=len(offers), snapshot_step=choice.passed_over,
                     store_step=choice.store_step)
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


def newest_reader(read: Callable[[], int | None], log: EventLog, url: str) -> Callable[[], int | None]:
    """A reader of the store's newest checkpoint step: `read`, called only when the reader is, giving
    None when the store cannot be read (reported: the snapshot may still be had). Raises nothing."""
    def newest() -> int | None:
        try:
            return read()
        except (OSError, ValueError) as e:
            log.emit("checkpoint.store_unreadable", error=repr(e), url=url)
            return None
    return newest
