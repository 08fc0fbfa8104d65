"""End a job once: the `result` record, then `live/round` flipped to `final` so every agent wakes.

Agents (a job succeeded, failed, or ran out of restarts) and providers (`kill_job`, the local reconciler)
end jobs the same way, through this module; `petctl/jobview/state.py` is the read side.
"""

from __future__ import annotations

import time
from typing import Any

from petctl.core.keys import JobKeys
from petctl.core.records import JobResult, Phase, Round, WireFormatError


def write_result(client: Any, job: str, state: str, reason: str, round_no: int | None = None,
                 node: str = "") -> bool:
    """Record how `job` ended (see `record_result`); `node` names the agent that ended it, if any."""
    return record_result(client, JobResult(state=state, reason=reason, ts=time.time(), round=round_no,
                                           job=job, node=node))


def record_result(client: Any, result: JobResult) -> bool:
    """Write `result` if no result exists yet, then set `live/round` final (carrying the restart count
    of the round it replaces, so `petctl status` still shows it).

    Returns False if another writer ended the job first (its result stands; `live/round` is made final
    if that writer could not). Raises etcd.EtcdException when etcd cannot be reached (the callers
    decide: an agent retries on its next look, a provider carries on).
    """
    import etcd

    keys = JobKeys(result.job)
    try:
        client.write(keys.result, result.to_json(), prevExist=False)
    except etcd.EtcdAlreadyExist:
        _finish_round(client, keys)  # its writer may have failed before `live/round` went final
        return False
    _set_final(client, keys, result)
    return True


def _set_final(client: Any, keys: JobKeys, result: JobResult) -> None:
    final = Round(round=result.round, phase=Phase.FINAL, ts=result.ts, restarts=_restarts(client, keys),
                  state=result.state, reason=result.reason)
    client.write(keys.round, final.to_json())


def _finish_round(client: Any, keys: JobKeys) -> None:
    """A result exists: make sure `live/round` says so too (the writer of the result may have lost etcd
    between its two writes; without this, agents waiting for the final round would wait forever)."""
    import etcd

    try:
        current = Round.from_json(client.read(keys.round).value)
    except (etcd.EtcdKeyNotFound, WireFormatError):
        current = None
    if current is not None and current.phase is Phase.FINAL:
        return
    try:
        existing = JobResult.from_json(client.read(keys.result).value)
    except (etcd.EtcdKeyNotFound, WireFormatError):
        return  # removed or unreadable: nothing sound to copy into the round
    _set_final(client, keys, existing)


def _restarts(client: Any, keys: JobKeys) -> int:
    """The current round's restart count; 0 if there is no round, or it cannot be read."""
    import etcd

    try:
        return Round.from_json(client.read(keys.round).value).restarts
    except (etcd.EtcdKeyNotFound, WireFormatError):
        return 0
