"""Resuming from an in-memory snapshot: what a rank offers, which one the job takes, how it travels.

On a resume every rank says which snapshot it holds (`SnapshotReader.offer`: only local rank 0 of a node
has one, and only after its header, its round and its checksum checked out); the offers are all-gathered
(one small collective, on every rank, whether or not it holds anything, so ranks never disagree on the
protocol); rank 0 compares them with the store's newest step and says what the job takes
(`snapselect.newest_common`); the holder reads its payload and broadcasts it, as today's resume
broadcasts rank 0's download; every rank decodes it. When no snapshot qualifies, or the holder cannot read
it after all, the caller falls back to the store.
"""

from __future__ import annotations

import mmap
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.core.eventlog import EventLog
from petctl.core.records import WireFormatError
from petctl.core.snapshotrecord import HEADER_SIZE, SnapshotHeader, read_header, stale_reason
from petctl.elastic.snapcodec import decode, payload_checksum
from petctl.elastic.snapselect import Offer, newest_common


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
    choice = newest_common(offers, store_step=store_step()) if comm.is_writer else None
    choice = comm.broadcast_object(choice)
    if choice.source != "snapshot":
        if comm.is_writer:
            log.emit("snapshot.passed_over", reason=choice.reason, offers=len(offers))
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
