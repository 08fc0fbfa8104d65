"""End a job once: the `result` record, then `live/round` flipped to `final` so every agent wakes.

Agents (a job succeeded, failed, or ran out of restarts) and providers (`kill_job`, the local reconciler)
end jobs the same way, through this module, on whichever `Store` backend the job uses;
`petctl/jobview/live.py` is the read side.
"""

from __future__ import annotations

import time

from petctl.core.keys import JobKeys
from petctl.core.records import JobResult, Phase, Round, WireFormatError
from petctl.core.store import Store


def write_result(store: Store, job: str, state: str, reason: str, round_no: int | None = None,
                 node: str = "") -> bool:
    """Record how `job` ended (see `record_result`); `node` names the agent that ended it, if any."""
    return record_result(store, JobResult(state=state, reason=reason, ts=time.time(), round=round_no,
                                          job=job, node=node))


def record_result(store: Store, result: JobResult) -> bool:
    """Write `result` if no result exists yet, then set `live/round` final (carrying the restart count
    of the round it replaces, so `petctl status` still shows it).

    Returns False if another writer ended the job first (its result stands; `live/round` is made final
    if that writer could not). Raises StoreError when etcd cannot be reached (the callers decide: an
    agent retries on its next look, a provider carries on).
    """
    keys = JobKeys(result.job)
    if not store.create(keys.result, result.to_json()):
        _finish_round(store, keys)  # its writer may have failed before `live/round` went final
        return False
    _set_final(store, keys, result)
    return True


def _set_final(store: Store, keys: JobKeys, result: JobResult) -> None:
    final = Round(round=result.round, phase=Phase.FINAL, ts=result.ts, restarts=_restarts(store, keys),
                  state=result.state, reason=result.reason)
    store.put(keys.round, final.to_json())


def _read(store: Store, key: str, record: type):
    """The record at `key`, or None when it is missing or unreadable."""
    entry = store.get(key)
    try:
        return None if entry is None else record.from_json(entry.value)
    except WireFormatError:
        return None


def _finish_round(store: Store, keys: JobKeys) -> None:
    """A result exists: make sure `live/round` says so too (the writer of the result may have lost etcd
    between its two writes; without this, agents waiting for the final round would wait forever)."""
    current = _read(store, keys.round, Round)
    if current is not None and current.phase is Phase.FINAL:
        return
    existing = _read(store, keys.result, JobResult)
    if existing is None:
        return  # removed or unreadable: nothing sound to copy into the round
    _set_final(store, keys, existing)


def _restarts(store: Store, keys: JobKeys) -> int:
    """The current round's restart count; 0 if there is no round, or it cannot be read."""
    current = _read(store, keys.round, Round)
    return 0 if current is None else current.restarts
