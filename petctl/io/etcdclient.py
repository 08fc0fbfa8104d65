"""A python-etcd client over several etcd members that never runs out of members to try.

python-etcd's multi-host mode (`host=((h, p), ...)`, `allow_reconnect=True`) keeps the members it has not
tried yet in `_machines_cache` and pops one each time a request to the current member fails. Nothing puts
them back: with `use_proxies=True` the cache is never refreshed, and without it the refresh asks the
failing member for `/v2/machines` (and the constructor asks the first member before the client exists, so
a member down at start-up is an exception at construction). Either way, once every member failed once the
cache is empty and every later failure raises `EtcdConnectionFailed('No more machines in the cluster')`:
the client is stuck on its last `_base_uri` for good, even after the other members came back.

`EndpointsClient` refills the cache from the configured endpoints whenever it runs dry, and gives up on a
request (`EtcdConnectionFailed`) only once every configured member failed for that same request, so the
next request tries them all again. It never asks etcd which members exist: the endpoints it was given
are the cluster (fixed addresses on AWS), so no advertised URL can lead it somewhere unreachable.

This module imports python-etcd at import time: petctl.io.etcd imports it only when a client is built.
"""

from __future__ import annotations

from typing import Any

import etcd

from petctl.io.etcdpki import EtcdTls


def client_for(pairs: list[tuple[str, int]], protocol: str, read_timeout: float,
               tls: EtcdTls | None = None) -> etcd.Client:
    """A plain client for one member (as before: its failures raise at once), an EndpointsClient for
    several. `tls`: the client's certificate and the CA that verifies etcd's (https endpoints)."""
    kwargs = _tls_kwargs(protocol, tls)
    if len(pairs) == 1:
        host, port = pairs[0]
        return etcd.Client(host=host, port=port, protocol=protocol, read_timeout=read_timeout,
                           allow_reconnect=False, **kwargs)
    return EndpointsClient(pairs, protocol, read_timeout, tls)


def _tls_kwargs(protocol: str, tls: EtcdTls | None) -> dict[str, Any]:
    if protocol != "https" or tls is None:
        return {}
    return {"cert": (tls.cert, tls.key), "ca_cert": tls.ca}


class EndpointsClient(etcd.Client):
    """python-etcd's client over a fixed list of members; see the module docstring for why.

    Like python-etcd's own client, one object is not meant to be shared by threads that use it at the
    same time (the current member and the failure count are per object): give each thread its client."""

    def __init__(self, pairs: list[tuple[str, int]], protocol: str, read_timeout: float,
                 tls: EtcdTls | None = None) -> None:
        self._endpoints = [f"{protocol}://{host}:{port}" for host, port in pairs]
        self._failed_in_request = 0
        super().__init__(host=tuple(pairs), protocol=protocol, read_timeout=read_timeout,
                         allow_reconnect=True, use_proxies=True, **_tls_kwargs(protocol, tls))
        self._machines_cache = self._others()

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def api_execute(self, path: str, method: str, params: Any = None, timeout: Any = None) -> Any:
        self._failed_in_request = 0
        return super().api_execute(path, method, params=params, timeout=timeout)

    def api_execute_json(self, path: str, method: str, params: Any = None, timeout: Any = None) -> Any:
        self._failed_in_request = 0
        return super().api_execute_json(path, method, params=params, timeout=timeout)

    def _next_server(self, cause: BaseException | None = None) -> str:
        """The member to try after the current one failed (python-etcd calls this on a connection
        failure). Raises EtcdConnectionFailed once every member failed for this request, with the cache
        refilled so the next request starts over."""
        self._failed_in_request += 1
        if self._failed_in_request >= len(self._endpoints):
            self._machines_cache = self._others()
            raise etcd.EtcdConnectionFailed(
                f"none of the {len(self._endpoints)} etcd members answered ({', '.join(self._endpoints)}); "
                f"last error: {cause!r}", cause=cause)
        if not self._machines_cache:
            self._machines_cache = self._others()
        return self._machines_cache.pop(0)

    def _others(self) -> list[str]:
        """Every configured member but the current one, in the configured order after it."""
        i = self._endpoints.index(self._base_uri) if self._base_uri in self._endpoints else -1
        return self._endpoints[i + 1:] + self._endpoints[:max(i, 0)]
