"""Read a job's live state from etcd: what `petctl status`, `hosts` and the tests look at.

The agents are the source of truth for ranks, rounds and restarts; this module only reads what they
publish (see docs/ARCHITECTURE.md for the schema) and never writes: ending a job is
`petctl.io.jobresult.write_result`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from petctl.core.keys import JobKeys


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
    """Two reads: the live prefix (heartbeats, round) and the nodes' published status.

    Only nodes with a live heartbeat are listed; a node's status without a heartbeat is a node that is
    gone (its status key outlives it for a while, by design, so `status` can say what it last did).
    """
    import etcd

    keys = JobKeys(job)
    state = JobState(job=job)
    try:
        for leaf in client.read(keys.base, recursive=False).leaves:
            if leaf.key == keys.spec:
                state.spec = _json(leaf.value)
            elif leaf.key == keys.result:
                state.result = _json(leaf.value)
    except etcd.EtcdKeyNotFound:
        return state
    statuses: dict[str, dict[str, Any]] = {}
    try:
        for leaf in client.read(keys.status, recursive=True).leaves:
            if not leaf.dir:
                statuses[leaf.key.rsplit("/", 1)[1]] = _json(leaf.value) or {}
    except etcd.EtcdKeyNotFound:
        pass
    try:
        live = client.read(keys.live, recursive=True)
    except etcd.EtcdKeyNotFound:
        return state
    for leaf in live.leaves:
        if leaf.dir:
            continue
        if leaf.key.startswith(keys.nodes + "/"):
            node_id = leaf.key.rsplit("/", 1)[1]
            beat = _json(leaf.value) or {}
            state.nodes[node_id] = {"node_id": node_id, **beat, **statuses.get(node_id, {})}
        elif leaf.key == keys.round:
            state.round = _json(leaf.value)
    return state
