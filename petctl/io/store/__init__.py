"""Open a `Store` (petctl/core/store.py) on an etcd endpoint, over the v3 backend (default) or v2's.

The backend modules are imported only here, inside `open_store`, so `petctl --help` and everything that
never talks to etcd import neither the v3 client (hpack) nor python-etcd. What every store's caller needs
besides, the errors a call can raise, is here too, not in io/etcd.py with the etcd server's process: an
agent never starts etcd, and should not load what starting it takes.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from petctl.core.endpoints import endpoint_scheme, parse_endpoints
from petctl.core.store import BACKENDS, DEFAULT_BACKEND, Backend, Store

if TYPE_CHECKING:
    from petctl.io.etcdpki import EtcdTls
    from petctl.io.store.v3 import LoopThread


def open_store(endpoint: str, backend: Backend = DEFAULT_BACKEND, tls: EtcdTls | None = None,
               timeout: float = 5.0, loop: LoopThread | None = None) -> Store:
    """A store on `endpoint` (`http(s)://host:port[,http(s)://host:port...]`, every member of one
    cluster). `tls`: this client's certificate and the CA that verifies etcd's (required for https).
    `timeout`: how long one call may take before it raises StoreUnavailable. `loop` (v3 only): an
    asyncio loop thread shared by many stores (a fleet bench); by default each v3 store runs its own.
    Raises ValueError (one line) for an endpoint that does not parse, an unknown backend, or https
    without `tls`; StoreUnavailable only from later calls (opening does not wait for etcd)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown store backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    scheme = endpoint_scheme(endpoint)
    members = parse_endpoints(endpoint)
    if scheme == "https" and tls is None:
        raise ValueError(f"etcd at {endpoint} requires a client certificate: no etcd credentials given")
    if timeout <= 0:
        raise ValueError(f"store timeout must be positive, not {timeout}")
    if backend == "v2":
        if loop is not None:
            raise ValueError("a shared loop is for the v3 backend only")
        from petctl.io.store.v2 import V2Store

        return V2Store(endpoint, tls if scheme == "https" else None, timeout)
    from petctl.io.store.v3 import V3Store

    return V3Store(members, tls if scheme == "https" else None, timeout, loop)


def store_errors() -> tuple[type[BaseException], ...]:
    """What an etcd call raises when the store cannot answer (down, frozen, restarting, replaced, a
    partition, no leader): a `Store`'s StoreError (petctl/core/store.py), every python-etcd error, and
    the socket and urllib3 errors it lets through (while some agent modules still call python-etcd;
    issue 27 moves them onto the Store).
    `EtcdKeyNotFound`, `EtcdCompareFailed` and the other answers etcd gives on purpose are subclasses:
    callers handle those by name, in an `except` before this tuple. python-etcd's and urllib3's errors are
    in it only once python-etcd is loaded (the v2 store, a v2 client): a process that never loaded it
    cannot raise them, and loading it only to name them cost a v3 agent 0.1 s of CPU (urllib3, dnspython)."""
    from petctl.core.store import StoreError

    etcd = sys.modules.get("etcd")  # python-etcd's, once anything imported it
    if etcd is None:
        return (StoreError, OSError)
    import urllib3.exceptions

    return (StoreError, etcd.EtcdException, urllib3.exceptions.HTTPError, OSError)
