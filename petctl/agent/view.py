"""What an agent knows about its job at one moment, as plain typed values (no I/O, no clock).

The rendezvous executor (rendezvous.py) reads etcd into these; the decisions (decisions.py, roundjudge.py)
read only these. Keeping them apart from both is what lets the decisions be tested by tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from petctl.core.records import JoinRecord, NodeRecord, Phase, Round


@dataclass(frozen=True)
class Snapshot:
    """The `live/` prefix as of one etcd index."""

    alive: frozenset[str] = frozenset()  # nodes whose heartbeat key exists
    nodes: Mapping[str, NodeRecord] = field(default_factory=dict)  # their heartbeat values, where readable
    round: Round | None = None
    round_index: int | None = None  # the modifiedIndex of `live/round`: what a CAS on it compares
    done: Mapping[int, frozenset[str]] = field(default_factory=dict)  # round -> nodes done in it
    mixed: Mapping[int, Mapping[str, str]] = field(default_factory=dict)  # round -> {done node: its failure}
    etcd_index: int = 0
    # False while etcd recently failed, stalled or lost our own heartbeat (agent/storehealth.py): a node
    # missing from `alive` may then be an expiry of the outage, not a loss, so nobody is judged by it.
    settled: bool = True

    def done_in(self, round_no: int) -> frozenset[str]:
        return self.done.get(round_no, frozenset())


@dataclass(frozen=True)
class Member:
    """One join record of a joining round, with the etcd index that orders arrivals."""

    record: JoinRecord
    created: int


@dataclass(frozen=True)
class Members:
    """The join records of round `round`, as read when the snapshot had index `read_at`.

    While the snapshot's index is still `read_at` nothing in etcd changed, so they are still current.
    """

    round: int
    records: Mapping[str, Member]
    read_at: int


@dataclass(frozen=True)
class RoundInfo:
    """This node's place in a frozen round: what its workers are started with."""

    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    ranks: Mapping[str, int]
    restarts: int
    cause: str
    started: float  # when this round was opened (for recovery timing)
    # The frozen round as read: what a node writes back if etcd lost it (not part of a RoundInfo's identity).
    record: Round | None = field(default=None, compare=False)

    @classmethod
    def of(cls, rnd: Round, node_id: str) -> RoundInfo:
        """Our place in `rnd`. Raises ValueError if it is not frozen or we are not in it."""
        if rnd.phase is not Phase.FROZEN or node_id not in rnd.ranks or rnd.round is None:
            raise ValueError(f"{node_id} is not a member of round {rnd.round} ({rnd.phase.value})")
        return cls(round=rnd.round, rank=rnd.ranks[node_id], world_size=len(rnd.ranks),
                   master_addr=rnd.master_addr, master_port=rnd.master_port, ranks=dict(rnd.ranks),
                   restarts=rnd.restarts, cause=rnd.cause, started=rnd.ts, record=rnd)
