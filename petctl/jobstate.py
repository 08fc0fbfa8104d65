"""Ending a job the way an agent does: `write_result` (used by kill_job and the local reconciler).

The read side that lived here (JobState, read_job_state) is petctl.jobview.state now.
"""

from __future__ import annotations

import json
import time

from petctl.core.keys import JobKeys


def write_result(client, job: str, state: str, reason: str, round_no: int | None = None) -> bool:
    """End the job once: record the result, then flip `live/round` to `final` so every agent wakes.

    Returns False if another writer ended the job first (its result stands).
    """
    import etcd

    keys = JobKeys(job)
    now = time.time()
    value = json.dumps({"state": state, "reason": reason, "ts": now, "round": round_no})
    try:
        client.write(keys.result, value, prevExist=False)
    except etcd.EtcdAlreadyExist:
        return False
    client.write(keys.round, json.dumps({"round": round_no, "phase": "final", "state": state,
                                         "reason": reason, "ts": now}))
    return True
