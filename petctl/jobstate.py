"""Read a job's live state from etcd: what `petctl status`, `hosts` and the tests look at.

The agents are the source of truth for ranks, rounds and restarts; this module only reads what they
publish (see docs/ARCHITECTURE.md for the schema) and never writes, except `write_result`, which lets a
provider end a job (kill_job) the same way an agent does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from petctl.keys import JobKeys


@dataclass
class JobState:
    job: str
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # node_id -> published node state
    round: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None

    @property
    def state(self) -> str:
        if self.result:
            return str(self.result.get("state", "unknown"))
        if self.round and self.round.get("phase") == "frozen":
            return "running"
        return "forming" if self.nodes or self.round else "pending"

    @property
    def ranks(self) -> dict[str, int]:
        """node_id -> node rank of the current frozen round (empty while forming)."""
        if not self.round or self.round.get("phase") != "frozen":
            return {}
        return {k: int(v) for k, v in (self.round.get("ranks") or {}).items()}

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "state": self.state, "round": self.round, "result": self.result,
                "world_size": self.world_size, "nodes": self.nodes}


def _json(value: str | None) -> Any:
    if not value:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return None


def read_job_state(client, job: str) -> JobState:
    """One recursive read of the job's keys (cheap, consistent as of one etcd index)."""
    import etcd

    keys = JobKeys(job)
    state = JobState(job=job)
    try:
        root = client.read(keys.base, recursive=True)
    except etcd.EtcdKeyNotFound:
        return state
    for leaf in root.leaves:
        if leaf.dir:
            continue
        if leaf.key.startswith(keys.nodes + "/"):
            node_id = leaf.key.rsplit("/", 1)[1]
            state.nodes[node_id] = _json(leaf.value) or {"node_id": node_id}
        elif leaf.key == keys.round:
            state.round = _json(leaf.value)
        elif leaf.key == keys.result:
            state.result = _json(leaf.value)
        elif leaf.key == keys.spec:
            state.spec = _json(leaf.value)
    return state


def write_result(client, job: str, state: str, reason: str, round_no: int | None = None) -> bool:
    """Record the job's final state once; returns False if another writer got there first."""
    import etcd

    value = json.dumps({"state": state, "reason": reason, "ts": time.time(), "round": round_no})
    try:
        client.write(JobKeys(job).result, value, prevExist=False)
        return True
    except etcd.EtcdAlreadyExist:
        return False
