"""The reconciler's link to its job in etcd: whether the job has ended, the current round's ranks, which
nodes have a heartbeat, and
recording the end when the reconciler is the one that ends it.

etcd being slow or down must not stop the instances (they may be training fine): a read that fails is
answered "not ended, no ranks", and the outage is reported once when it starts and once when it ends.
"""

from __future__ import annotations

from petctl.core.keys import JobKeys
from petctl.core.records import JobResult
from petctl.core.store import Store, StoreError
from petctl.io.eventlog import EventLog
from petctl.jobview.live import ranks_of, read_result, read_round


class JobLink:
    def __init__(self, store: Store, job: str, events: EventLog) -> None:
        self.store = store
        self.job = job
        self.events = events
        self.failures = 0  # consecutive failed reads; > 0 while etcd is out of reach

    def _failed(self, error: Exception) -> None:
        if self.failures == 0:
            self.events.emit("reconciler.etcd_unreachable", error=str(error))
        self.failures += 1

    def _answered(self) -> None:
        if self.failures:
            self.events.emit("reconciler.etcd_reachable", failed_reads=self.failures)
        self.failures = 0

    def result(self) -> JobResult | None:
        """The job's result (None while it runs, or while etcd does not answer)."""
        try:
            result = read_result(self.store, self.job)
        except StoreError as e:
            self._failed(e)
            return None
        self._answered()
        return result

    def ranks(self) -> dict[str, int]:
        """node_id -> rank in the current frozen round ({} while forming, or while etcd does not answer)."""
        try:
            current = read_round(self.store, self.job)
        except StoreError as e:
            self._failed(e)
            return {}
        self._answered()
        return ranks_of(current)

    def alive(self) -> set[str]:
        """Nodes whose agent has a heartbeat in etcd (empty while etcd does not answer)."""
        nodes = JobKeys(self.job).nodes
        try:
            listing = self.store.list(nodes)
        except StoreError as e:
            self._failed(e)
            return set()
        self._answered()
        return {node for node in listing.leaves(nodes) if "/" not in node}

    def end(self, state: str, reason: str) -> bool:
        """Record the job's end (as an agent would); False when etcd refused or another writer was first."""
        from petctl.io.jobresult import write_result

        try:
            return write_result(self.store, self.job, state, reason)
        except StoreError as e:
            self._failed(e)
            return False
