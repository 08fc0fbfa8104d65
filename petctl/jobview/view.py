"""One job's records, read the same way whichever provider keeps them.

A provider says where a job's records are (`JobSources`: its etcd when it answers from here, the job's
prefix, the provider's own log reader); `JobView` reads status, events, logs, result, goodput and cost
from them. Which copy answers is decided here, once: etcd while it answers, the agents' mirror when it
does not (or has forgotten the job).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from petctl.core.errors import PetctlError, ProviderError
from petctl.core.records import JobResult
from petctl.core.store import JOB_DEFAULT_BACKEND, Backend, Store, StoreError
from petctl.io.etcdpki import EtcdTls
from petctl.jobview.accounting import Accounting, BilledSpan, account
from petctl.jobview.cost import CostReport, Prices, billed_usage
from petctl.jobview.live import JobState, mirror_result, read_job_state, read_result, state_from_mirror
from petctl.jobview.prefix import Corrupt, PrefixReader, etcd_events, merge, mirror_events

T = TypeVar("T")
LogReader = Callable[[str | None, bool], Iterator[str]]  # (node or None for all, follow) -> lines


@dataclass(frozen=True)
class JobSources:
    """Where one job's records are, as its provider knows them."""

    job: str
    etcd_endpoint: str = ""  # "" when etcd does not answer from this machine
    mirror: PrefixReader | None = None  # the job's prefix: the agents' status/events/logs, result.json
    logs: LogReader | None = None  # the provider's reader of the node logs
    extra_events: Callable[[], list[dict[str, Any]]] | None = None  # events kept by the provider itself
    etcd_tls: EtcdTls | None = None  # the client certificate an https etcd asks for (the operator's)
    etcd_store: Backend = JOB_DEFAULT_BACKEND  # the API the job's agents write with (JobSpec.etcd_store)
    # The provider's record of each instance's launch and end (what it bills); None where it keeps none.
    # May raise PetctlError (an API that did not answer): instance time then falls back to the agents'.
    billing: Callable[[], list[BilledSpan]] | None = None


class JobView:
    """Status, events, logs, result, goodput and cost of one job. Corrupt records are skipped and counted
    in `corrupt`; copies that could not be read are listed in `unreadable` (one line each). `prices` is
    asked for only when a cost is wanted (building it may open a cloud session)."""

    def __init__(self, sources: JobSources, prices: Callable[[], Prices] | None = None) -> None:
        self.sources = sources
        self.prices = prices
        self.corrupt = Corrupt()
        self.unreadable: list[str] = []

    @property
    def job(self) -> str:
        return self.sources.job

    def _read(self, read: Callable[[Store], T]) -> T:
        """`read` on a store opened for this one read (closed after: a v3 store holds a loop thread).
        Raises StoreError when etcd fails."""
        from petctl.io.store import open_store

        store = open_store(self.sources.etcd_endpoint, self.sources.etcd_store, self.sources.etcd_tls, 3.0)
        try:
            return read(store)
        finally:
            store.close()

    def _etcd_failed(self, error: Exception) -> None:
        self.unreadable.append(f"etcd at {self.sources.etcd_endpoint} did not answer: {error}")

    def state(self) -> JobState:
        """The live state: etcd's, else the agents' mirror. Raises ProviderError when neither is readable."""
        endpoint, mirror = self.sources.etcd_endpoint, self.sources.mirror
        if endpoint:
            try:
                state = self._read(lambda store: read_job_state(store, self.job, self.corrupt))
            except StoreError as e:
                if mirror is None:
                    raise ProviderError(f"cannot read job {self.job!r} from etcd at {endpoint}: {e}") from e
                self._etcd_failed(e)
            else:
                if state.result is None and mirror is not None:  # etcd forgot it; the prefix did not
                    state.result = mirror_result(mirror, self.corrupt)
                return state
        if mirror is None:
            return JobState(job=self.job)
        return state_from_mirror(self.job, mirror, self.corrupt)

    def result(self) -> JobResult | None:
        """How the job ended (None while it runs): etcd's record, else the one in the job's prefix."""
        if self.sources.etcd_endpoint:
            try:
                found = self._read(lambda store: read_result(store, self.job, self.corrupt))
            except StoreError as e:
                self._etcd_failed(e)
            else:
                if found is not None:
                    return found
        return mirror_result(self.sources.mirror, self.corrupt) if self.sources.mirror else None

    def events(self) -> list[dict[str, Any]]:
        """Every copy of the timeline merged: etcd's (while it answers), the mirror's, the provider's."""
        copies: list[list[dict[str, Any]]] = []
        if self.sources.etcd_endpoint:
            try:
                copies.append(self._read(lambda store: etcd_events(store, self.job, self.corrupt)))
            except StoreError as e:
                self._etcd_failed(e)
        if self.sources.mirror is not None:
            copies.append(mirror_events(self.sources.mirror, self.corrupt))
        if self.sources.extra_events is not None:
            copies.append(self.sources.extra_events())
        return merge(*copies)

    def logs(self, node: str | None = None, follow: bool = False) -> Iterator[str]:
        """Lines of the node logs, each prefixed `[node] ` unless one node is asked for."""
        if self.sources.logs is None:
            raise ProviderError(f"no logs are kept for job {self.job!r}")
        return self.sources.logs(node, follow)

    def billed(self) -> list[BilledSpan] | None:
        """The provider's record of its instances' launches and ends, read once per view; None when it
        keeps none or could not be read (said in `notes`): instance time then comes from the agents."""
        if not hasattr(self, "_billed"):
            self._billed: list[BilledSpan] | None = None
            if self.sources.billing is not None:
                try:
                    self._billed = self.sources.billing()
                except PetctlError as e:
                    self.unreadable.append(f"the provider's instance record did not answer ({e}): "
                                           "instance time from the agents' start and exit")
        return self._billed

    def accounting(self, events: list[dict[str, Any]], running: bool) -> Accounting:
        return account(events, now=time.time() if running else None, billed=self.billed())

    def cost(self, events: list[dict[str, Any]], running: bool) -> CostReport | None:
        """What the job's billed instance hours cost, or None where the provider prices nothing.
        Raises PetctlError when the prices cannot be read."""
        if self.prices is None:
            return None
        return billed_usage(events, time.time() if running else None, self.billed(), self.prices())

    def notes(self) -> list[str]:
        """What the user should know about how this view was read (skipped records, silent copies)."""
        corrupt = self.corrupt.note()
        return [*dict.fromkeys(self.unreadable), *([corrupt] if corrupt else [])]
