"""Checks of what an etcd user may do: a call refused for lack of permission, and for nothing else."""

from __future__ import annotations

from collections.abc import Callable

import etcd


def denied(call: Callable[[], object]) -> bool:
    """Whether etcd refused the call for lack of permission (and nothing else)."""
    try:
        call()
    except etcd.EtcdInsufficientPermissions:
        return True
    return False
