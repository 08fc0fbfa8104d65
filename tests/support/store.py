"""The one way tests read and write etcd: a `Store` (petctl/core/store.py), never python-etcd directly.

`store_for` opens one on a test's etcd with the backend a job's agents use by default
(`JOB_DEFAULT_BACKEND`), so a test reads what the agents wrote (etcd 3.5 keeps its v2 and v3 keyspaces
apart). Close it when done (a v3 store holds a loop thread), or use it as a context manager via
`contextlib.closing`.
"""

from __future__ import annotations

from petctl.core.store import JOB_DEFAULT_BACKEND, Backend, Store
from petctl.io.etcdpki import EtcdTls
from petctl.io.store import open_store


def store_for(endpoint: str, tls: EtcdTls | None = None, backend: Backend = JOB_DEFAULT_BACKEND,
              timeout: float = 3.0) -> Store:
    """A store on `endpoint` (a test's etcd, `http(s)://...`), as `tls`'s user when it is https."""
    return open_store(endpoint, backend, tls, timeout)
