"""Reads a job's `live/` prefix and join records from etcd into typed views (view.py).

Every value is parsed into its record (core/records.py). An unreadable heartbeat or join record is skipped,
counted (`corrupt_records`, published in the node status) and reported once per key; an unreadable
`live/round` is fatal (WireFormatError), because then no agent can know where the job stands.
"""

from __future__ import annotations

import etcd

from petctl.agent.view import Member, Snapshot
from petctl.agent.watcher import RequestStats
from petctl.core.eventlog import EventLog
from petctl.core.keys import JobKeys
from petctl.core.records import DoneRecord, JoinRecord, NodeRecord, Round, WireFormatError


class LiveReader:
    def __init__(self, client: etcd.Client, keys: JobKeys, stats: RequestStats, events: EventLog) -> None:
        self.client = client
        self.keys = keys
        self.stats = stats
        self.events = events
        self.corrupt_records = 0  # unreadable join/heartbeat values seen (skipped)
        self._corrupt_seen: set[str] = set()

    def snapshot(self) -> Snapshot:
        """One read of `live/`. Raises WireFormatError if `live/round` is not a round record: only a bug
        or a foreign writer does that, and no agent can know what the job's state is then."""
        self.stats.reads += 1
        try:
            r = self.client.read(self.keys.live, recursive=True)
        except etcd.EtcdKeyNotFound:
            return Snapshot()
        alive: set[str] = set()
        nodes: dict[str, NodeRecord] = {}
        done: dict[int, set[str]] = {}
        mixed: dict[int, dict[str, str]] = {}
        rnd, index = None, None
        nodes_prefix, done_prefix = self.keys.nodes + "/", self.keys.live + "/done/"
        for leaf in r.leaves:
            if leaf.dir:
                continue
            if leaf.key.startswith(nodes_prefix):
                node = leaf.key[len(nodes_prefix):]
                alive.add(node)  # the key's presence is what alive means, whatever its value
                try:
                    nodes[node] = NodeRecord.from_json(leaf.value)
                except WireFormatError as e:
                    self._corrupt(leaf.key, e)
            elif leaf.key == self.keys.round:
                rnd, index = Round.from_json(leaf.value), leaf.modifiedIndex
            elif leaf.key.startswith(done_prefix):
                round_no, node = leaf.key[len(done_prefix):].split("/", 1)
                done.setdefault(int(round_no), set()).add(node)  # its presence is what done means
                try:
                    if failure := DoneRecord.from_json(leaf.value).failure:
                        mixed.setdefault(int(round_no), {})[node] = failure
                except WireFormatError as e:
                    self._corrupt(leaf.key, e)
        return Snapshot(alive=frozenset(alive), nodes=nodes, round=rnd, round_index=index,
                        done={n: frozenset(s) for n, s in done.items()}, mixed=mixed, etcd_index=r.etcd_index)

    def members(self, round_no: int) -> dict[str, Member]:
        """The join records of `round_no` (unreadable ones skipped and counted)."""
        self.stats.reads += 1
        try:
            r = self.client.read(self.keys.round_members(round_no), recursive=True)
        except etcd.EtcdKeyNotFound:
            return {}
        out: dict[str, Member] = {}
        for leaf in r.leaves:
            if leaf.dir:
                continue
            try:
                out[leaf.key.rsplit("/", 1)[1]] = Member(JoinRecord.from_json(leaf.value), leaf.createdIndex)
            except WireFormatError as e:
                self._corrupt(leaf.key, e)
        return out

    def _corrupt(self, key: str, error: WireFormatError) -> None:
        self.corrupt_records += 1
        if key not in self._corrupt_seen:  # once per key: a snapshot is read many times a second
            self._corrupt_seen.add(key)
            self.events.emit("rendezvous.corrupt_record", key=key, error=str(error))

