"""Checks of what an etcd user may do: a call refused for lack of permission, and for nothing else (v2
through python-etcd, v3 through etcd3aio)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import etcd


def denied(call: Callable[[], object]) -> bool:
    """Whether etcd refused the call for lack of permission (and nothing else)."""
    try:
        call()
    except etcd.EtcdInsufficientPermissions:
        return True
    return False


def refused(call: Callable[[], object]) -> bool:
    """Whether a `Store` call was refused for lack of permission (StoreDenied), and for nothing else:
    any other failure propagates."""
    from petctl.core.store import StoreDenied

    try:
        call()
    except StoreDenied:
        return True
    return False


async def denied_v3(call: Awaitable[object]) -> bool:
    """Whether etcd's v3 API (through etcd3aio) refused the call for lack of permission or of a known
    user (PERMISSION_DENIED, UNAUTHENTICATED; etcd 3.5's maintenance calls answer UNKNOWN with "auth:
    permission denied"), and for nothing else: any other failure propagates."""
    import grpc

    from petctl.io.store.v3 import import_etcd3aio

    mod = import_etcd3aio()
    try:
        await call
    except (mod.EtcdPermissionDeniedError, mod.EtcdUnauthenticatedError):
        return True
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            return True
        if e.code() == grpc.StatusCode.UNKNOWN and "permission denied" in (e.details() or ""):
            return True
        raise
    return False
