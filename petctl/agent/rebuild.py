"""Writing a job's state back into an etcd that lost it: what replacing the etcd host does.

On AWS the etcd host keeps its fixed address when it is replaced, but not its data: the agents find an
empty store where their job was. Each of them holds what matters (the spec, the round it runs in with its
ranks and restart count), so the first to notice writes it back, and the job carries on in the same round
with no restart (the heartbeats are re-asserted by heartbeat.py; membership is not judged until they are:
storehealth.py). Every write is create-only (`prevExist=False`): several agents may rebuild at once, and
the first one wins.

A job that had already ended must stay ended: its result is also stored in the job's prefix (the mirror),
so it is read back from there and recorded again, instead of the round being rebuilt.
"""

from __future__ import annotations

import etcd

from petctl.agent.mirror import Mirror
from petctl.agent.outage import describe
from petctl.agent.rendezvous import EtcdRendezvous
from petctl.core.eventlog import EventLog
from petctl.core.records import JobResult, Round, WireFormatError
from petctl.io.jobresult import record_result


class StoreRebuilder:
    def __init__(self, rdzv: EtcdRendezvous, mirror: Mirror | None, spec_json: str, events: EventLog) -> None:
        self.rdzv = rdzv
        self.mirror = mirror
        self.spec_json = spec_json
        self.events = events

    def rebuild(self, rnd: Round) -> None:
        """etcd answers but holds no round while we run `rnd`: write back the result if the job ended,
        else `rnd` and the spec. Raises one of `io.etcd.store_errors()` if etcd fails (the round runner
        retries on its next look)."""
        prior = self._stored_result()
        if prior is not None:
            if record_result(self.rdzv.client, prior):
                self.events.emit("store.rebuilt", result=prior.state, round=prior.round)
            return
        if self.rdzv.create_round(rnd):
            self.events.emit("store.rebuilt", round=rnd.round, phase=rnd.phase.value, restarts=rnd.restarts)
        try:
            self.rdzv.client.write(self.rdzv.keys.spec, self.spec_json, prevExist=False)
        except etcd.EtcdAlreadyExist:
            pass  # another agent put it back first

    def _stored_result(self) -> JobResult | None:
        if self.mirror is None:
            return None
        try:
            return self.mirror.read_result()
        except (OSError, WireFormatError) as e:  # unreadable: rebuilding the round is still the right call
            self.events.emit("store.result_unreadable", error=describe(e))
            return None
