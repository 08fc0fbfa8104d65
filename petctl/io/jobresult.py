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

    Returns False if another writer ended the job first (its result stands). Raises etcd.EtcdException
    when etcd cannot be reached (the callers decide: an agent crashes loudly, a provider carries on).
    """
    import etcd

    keys = JobKeys(result.job)
    try:
        client.write(keys.result, result.to_json(), prevExist=False)
    except etcd.EtcdAlreadyExist:
        return False
    final = Round(round=result.round, phase=Phase.FINAL, ts=result.ts, restarts=_restarts(client, keys),
                  state=result.state, reason=result.reason)
    client.write(keys.round, final.to_json())
    return True


def _restarts(client: Any, keys: JobKeys) -> int:
    """The current round's restart count; 0 if there is no round, or it cannot be read."""
    import etcd

    try:
        return Round.from_json(client.read(keys.round).value).restarts
    except (etcd.EtcdKeyNotFound, WireFormatError):
        return 0
