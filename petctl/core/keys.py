"""The etcd key layout of a job, in one place.

Everything a job writes lives under `/petctl/jobs/<job>/`. Keys that agents watch for membership
(`live/`) are kept apart from keys written often (status is the heartbeat value itself, refreshed with
`refresh=True`, which etcd does not report to watchers), so a watch wakes only on events that matter.

    spec                    JobSpec JSON, written once by the provider
    desired                 desired node count (the provider's view; informational for agents)
    live/nodes/<node_id>    heartbeat, TTL, refreshed silently; value = {node_id, host_addr, pid}
    live/round              the current rendezvous round (JSON), changed only by compare-and-swap
    live/done/<n>/<node_id> node finished round n with all workers exiting 0
    rounds/<n>/<node_id>    join records of round n (TTL'd; outside live/ so joins wake only the closer)
    status/<node_id>        the node's published state (rank, round, step, ...), TTL'd; outside live/
                            so frequent updates never wake the agents' watches
    result                  final job state {state, reason, ts}; its presence ends the job
    events/                 append-only structured events (in-order keys, TTL'd)
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
