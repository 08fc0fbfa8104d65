"""Builders shared by the round-decision tables: what etcd would hold, as typed records, and a fixed
clock (tests/agent/test_round_decisions.py, tests/agent/test_round_judge.py)."""

from __future__ import annotations

from petctl.agent.decisions import (
    Member,
    Members,
    Now,
    RendezvousState,
    Settings,
    StoreView,
    decide,
)
from petctl.core.records import JoinRecord, Phase, Round

T0 = 1000.0  # monotonic "now" of the cases: joined_at, min_reached_at... are relative to it
WALL = 5000.0  # wall clock of the cases (round timestamps)
INDEX = 77  # the snapshot's etcd index


def settings(me: str = "me", **kw) -> Settings:
    base = dict(node_id=me, min_nodes=1, max_nodes=4, initial_size=1, last_call=1.0, initial_wait=30.0,
                join_timeout=600.0, stop_grace=5.0, max_restarts=3)
    base.update(kw)
    return Settings(**base)


def joining(n: int = 2, prev: dict[str, int] | None = None, ts: float = WALL) -> Round:
    return Round(round=n, phase=Phase.JOINING, ts=ts, prev_ranks=prev or {})


def frozen_round(n: int, ranks: dict[str, int], **kw) -> Round:
    return Round(round=n, phase=Phase.FROZEN, ts=WALL, ranks=ranks, world_size=len(ranks),
                 master_addr="10.0.0.1", master_port=29500, **kw)


def snapshot(alive, rnd: Round | None, done: dict[int, set[str]] | None = None) -> StoreView:
    return StoreView(alive=frozenset(alive), round=rnd, round_index=5 if rnd else None,
                    done={k: frozenset(v) for k, v in (done or {}).items()}, etcd_index=INDEX)


def members(round_no: int, joins: list[tuple[str, int | None]]) -> Members:
    """Join records in arrival order: (node, prev_rank)."""
    recs = {node: Member(JoinRecord(node_id=node, addr=f"addr-{node}", port=1000 + i, ts=WALL,
                                    prev_rank=prev), created=100 + i)
            for i, (node, prev) in enumerate(joins)}
    return Members(round=round_no, records=recs, read_at=INDEX)


def joined_state(round_no: int, joins: list[tuple[str, int | None]], joined_for: float = 0.0,
                 min_waited: float | None = None, **kw) -> RendezvousState:
    """The state of a node that joined `round_no` `joined_for` seconds ago and has read `joins`."""
    return RendezvousState(started=T0 - joined_for, joined_round=round_no, joined_at=T0 - joined_for,
                           members=members(round_no, joins),
                           min_reached_at=None if min_waited is None else T0 - min_waited, **kw)


def now(dt: float = 0.0, wall: float = WALL) -> Now:
    return Now(mono=T0 + dt, wall=wall + dt)


def act(snap, state, s, at=None):
    return decide(snap, state, s, at or now())[0]
