"""The etcd key layout of a job, in one place (docs/ARCHITECTURE.md has it with each value's record).

Everything a job writes lives under `/petctl/jobs/<job>/`. Agents watch `live/` (see agent/rendezvous.py), so
only what changes membership or the round lives there: a heartbeat lives under a lease kept alive, which
etcd does not report to watchers (petctl/core/store.py), and the keys written often (status, join
records, events) live outside `live/`, so a watch wakes only on events that matter.

    spec                    JobSpec JSON, written once by the provider
    desired                 desired node count (the provider's view; informational for agents)
    live/nodes/<node_id>    heartbeat (NodeRecord), under a lease kept alive: its presence means alive
    live/round              the current round (Round), changed only by compare-and-swap
    live/done/<n>/<node_id> DoneRecord: the node finished round n with all workers exiting 0
    rounds/<n>/<node_id>    JoinRecord of round n (under a lease; outside live/ so joins wake nobody: the
                            closer polls for them)
    status/<node_id>        NodeStatus (rank, round, step, failures, ...), under a lease, rewritten every few
                            seconds: outside live/ so it never wakes a watch
    result                  JobResult; its presence ends the job (`live/round` goes final with it)
    events/<ns>-<node_id>   append-only structured events (time-ordered keys, under a lease)
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "/petctl/jobs"


@dataclass(frozen=True)
class JobKeys:
    job: str

    @property
    def base(self) -> str:
        return f"{ROOT}/{self.job}"

    @property
    def spec(self) -> str:
        return f"{self.base}/spec"

    @property
    def desired(self) -> str:
        return f"{self.base}/desired"

    @property
    def live(self) -> str:
        return f"{self.base}/live"

    @property
    def nodes(self) -> str:
        return f"{self.base}/live/nodes"

    def node(self, node_id: str) -> str:
        return f"{self.nodes}/{node_id}"

    @property
    def round(self) -> str:
        return f"{self.base}/live/round"

    def round_members(self, round_no: int) -> str:
        return f"{self.base}/rounds/{round_no}"

    def round_member(self, round_no: int, node_id: str) -> str:
        return f"{self.base}/rounds/{round_no}/{node_id}"

    def done(self, round_no: int) -> str:
        return f"{self.base}/live/done/{round_no}"

    @property
    def status(self) -> str:
        return f"{self.base}/status"

    def node_status(self, node_id: str) -> str:
        return f"{self.base}/status/{node_id}"

    @property
    def result(self) -> str:
        return f"{self.base}/result"

    @property
    def events(self) -> str:
        return f"{self.base}/events"

    def event(self, node_id: str, ns: int) -> str:
        """One event's key: its write time in nanoseconds, zero-padded so that key order is time order
        (as v2's in-order keys were), then its writer, so two nodes writing in the same nanosecond do
        not collide."""
        return f"{self.events}/{ns:020d}-{node_id}"
