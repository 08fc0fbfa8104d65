"""A job's live state: its nodes, its current round and its result, as the agents publish them.

The agents are the source of truth for ranks, rounds and restarts; this module only reads what they
published (the schema is docs/ARCHITECTURE.md's, the types petctl/core/records.py's) and never writes.
Two sources give the same `JobState`: etcd (`read_job_state`), and the agents' mirror in the job's prefix
(`state_from_mirror`), which is all there is when etcd is out of reach (AWS: etcd inside the VPC) or gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from petctl.core.keys import JobKeys
from petctl.core.records import JobResult, NodeRecord, NodeStatus, Phase, Round, WireFormatError
from petctl.core.store import Store
from petctl.jobview.prefix import Corrupt, PrefixReader

FINAL_STATES = ("succeeded", "failed", "killed")


@dataclass
class JobState:
    job: str
    nodes: dict[str, NodeStatus] = field(default_factory=dict)  # live nodes: node_id -> published state
    round: Round | None = None
    result: JobResult | None = None
    source: str = "etcd"  # etcd | mirror: where this state was read

    @property
    def state(self) -> str:
        if self.result is not None:
            return self.result.state or "unknown"
        if self.round is not None and self.round.phase is Phase.FROZEN:
            return "running"
        return "forming" if self.nodes or self.round else "pending"

    @property
    def ranks(self) -> dict[str, int]:
        """node_id -> node rank of the current frozen round (empty while forming)."""
        return ranks_of(self.round)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "state": self.state, "source": self.source,
                "round": self.round.to_dict() if self.round else None,
                "result": self.result.to_dict() if self.result else None,
                "world_size": self.world_size,
                "nodes": {node_id: node.to_dict() for node_id, node in self.nodes.items()}}


def ranks_of(current: Round | None) -> dict[str, int]:
    """node_id -> node rank in `current` when it is frozen (empty while a round forms, or after the end)."""
    if current is None or current.phase is not Phase.FROZEN:
        return {}
    return dict(current.ranks)


def parse(cls: type, value: str | bytes | None, kind: str, corrupt: Corrupt | None):
    """`cls.from_json(value)`, or None (counted in `corrupt`) when the value is not a valid record."""
    try:
        return cls.from_json(value)
    except WireFormatError as e:
        if corrupt is not None:
            corrupt.add(kind, e)
        return None


def ended(value: str | bytes | None, corrupt: Corrupt | None = None) -> JobResult | None:
    """The job's result from a stored `result` value; None when there is none.

    The result's presence is what ends a job, whatever its content: an unreadable one still ends it
    (as state "unknown", counted in `corrupt`), so a reader never keeps running a job that is over."""
    if value is None:
        return None
    result = parse(JobResult, value, "result", corrupt)
    if result is None:
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        return JobResult(state="unknown", reason=f"unreadable result record: {text[:200]!r}", ts=0.0)
    return result


def read_result(store: Store, job: str, corrupt: Corrupt | None = None) -> JobResult | None:
    """The job's result in etcd (None while it runs). Raises StoreError when etcd fails."""
    entry = store.get(JobKeys(job).result)
    return None if entry is None else ended(entry.value, corrupt)


def read_round(store: Store, job: str, corrupt: Corrupt | None = None) -> Round | None:
    """The job's `live/round` (None before the first). Raises StoreError when etcd fails."""
    entry = store.get(JobKeys(job).round)
    return None if entry is None else parse(Round, entry.value, "round", corrupt)


def read_job_state(store: Store, job: str, corrupt: Corrupt | None = None) -> JobState:
    """The job's state from etcd in three reads: the job's result, the published statuses, `live/`.

    Only nodes with a live heartbeat are listed; a node's status without a heartbeat is a node that is
    gone (its status key outlives it for a while, by design, so a reader can say what it last did).
    Raises StoreError when etcd cannot be read.
    """
    keys = JobKeys(job)
    state = JobState(job=job, result=read_result(store, job, corrupt))
    statuses: dict[str, NodeStatus] = {}
    for entry in store.list(keys.status).entries:
        if status := parse(NodeStatus, entry.value, "node status", corrupt):
            statuses[entry.key.rsplit("/", 1)[1]] = status
    for entry in store.list(keys.live).entries:
        if entry.key.startswith(keys.nodes + "/"):
            node_id = entry.key.rsplit("/", 1)[1]
            beat = parse(NodeRecord, entry.value, "heartbeat", corrupt)
            state.nodes[node_id] = statuses.get(node_id) or _unpublished(node_id, beat)
        elif entry.key == keys.round:
            state.round = parse(Round, entry.value, "round", corrupt)
    return state


def _unpublished(node_id: str, beat: NodeRecord | None) -> NodeStatus:
    """A node that is alive (its heartbeat is there) but has not published a status yet."""
    return NodeStatus(node_id=node_id, state="", updated=0.0, host_addr=beat.host_addr if beat else "",
                      pid=beat.pid if beat else None)


def mirror_result(reader: PrefixReader, corrupt: Corrupt | None = None) -> JobResult | None:
    """The job's `result.json` in its prefix (the agent that ended the job wrote it, or kill_job)."""
    return ended(reader.get_bytes("result.json"), corrupt)


def mirror_statuses(reader: PrefixReader, corrupt: Corrupt | None = None) -> dict[str, NodeStatus]:
    """node_id -> the status each agent last mirrored (`status/<node_id>.json`)."""
    out: dict[str, NodeStatus] = {}
    for name in reader.list_keys("status"):
        node_file = name[len("status/"):]
        if "/" in node_file or not node_file.endswith(".json") or node_file.startswith("_"):
            continue
        status = parse(NodeStatus, reader.get_bytes(name), "node status", corrupt)
        if status is not None:
            out[node_file[: -len(".json")]] = status
    return out


def state_from_mirror(job: str, reader: PrefixReader, corrupt: Corrupt | None = None) -> JobState:
    """The job's state rebuilt from the nodes' own mirrored reports, for when etcd is out of reach.

    The round is the latest one whose ranked members report it. A node's "succeeded" only means its own
    workers exited 0; the job's end is its `result.json`.
    """
    nodes = mirror_statuses(reader, corrupt)
    state = JobState(job=job, nodes=nodes, result=mirror_result(reader, corrupt), source="mirror")
    ranked = {k: n for k, n in nodes.items() if n.rank is not None and n.round is not None}
    if ranked:
        latest = max(int(n.round) for n in ranked.values())  # type: ignore[arg-type]
        members = {k: int(n.rank) for k, n in ranked.items() if n.round == latest}  # type: ignore[arg-type]
        state.round = Round(round=latest, phase=Phase.FROZEN, ts=min(n.updated for n in ranked.values()),
                            ranks=members, world_size=len(members))
    return state
