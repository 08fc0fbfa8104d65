"""Checks of what an etcd user may do: a call refused for lack of permission, and for nothing else (v2
through python-etcd, v3 through petctl's gRPC client, petctl/io/store/v3wire.py)."""

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
    """Whether etcd's v3 API refused the call for lack of permission or of a known user
    (PERMISSION_DENIED, UNAUTHENTICATED; etcd 3.5's maintenance calls answer UNKNOWN with "auth:
    permission denied"), and for nothing else: any other failure propagates."""
    from petctl.io.store.v3wire import GrpcError, Status

    try:
        await call
    except GrpcError as e:
        if e.code in (Status.PERMISSION_DENIED, Status.UNAUTHENTICATED):
            return True
        if e.code == Status.UNKNOWN and "permission denied" in e.detail:
            return True
        raise
    return False
