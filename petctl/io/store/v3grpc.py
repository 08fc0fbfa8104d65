"""etcd3aio for the v3 backend: importing it beside python-etcd, and its failures as the store's errors.

Both python-etcd and etcd3aio's generated protobuf modules are a top-level package named `etcd`:
python-etcd's is a regular package, etcd3aio's (`etcd3aio/proto/etcd/api/...`, reached through the
`etcd3aio/proto` directory its `_protobuf.py` puts first on sys.path) a namespace package, and a regular
package always wins the name. Importing etcd3aio in a process that has python-etcd installed therefore
fails (`No module named 'etcd.api'`) whatever the order, unless etcd3aio's directory is added to
python-etcd's package path first: then `etcd.Client` is python-etcd's and `etcd.api` etcd3aio's, in one
process (the agent needs both while v2 is supported).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from petctl.core.store import LeaseExpired, StoreDenied, StoreError, StoreUnavailable


def import_etcd3aio() -> ModuleType:
    """etcd3aio, importable beside python-etcd (see the module docstring). Raises ImportError when
    etcd3aio is not installed."""
    try:
        import etcd  # python-etcd: it must own the name `etcd`, with etcd3aio's protos added below
    except ImportError:  # no python-etcd: etcd3aio's namespace package has the name to itself
        etcd = None
    spec = importlib.util.find_spec("etcd3aio")
    if spec is None or spec.origin is None:
        raise ImportError("etcd3aio is not installed: pip install 'etcd3aio>=0.3,<0.4'")
    protos = str(Path(spec.origin).parent / "proto" / "etcd")
    if etcd is not None and protos not in list(etcd.__path__):
        etcd.__path__.append(protos)
    import etcd3aio

    return etcd3aio


def store_error(e: BaseException, what: str) -> StoreError | None:
    """What an etcd3aio or gRPC failure means to a store caller, or None for one that is not a store
    failure (a bug: let it raise). No permission, or a certificate naming no user → StoreDenied; a lease
    etcd no longer has → LeaseExpired; down, unreachable, too slow, no leader → StoreUnavailable."""
    import grpc
    from etcd3aio import errors

    if isinstance(e, StoreError):
        return e
    if isinstance(e, (errors.EtcdPermissionDeniedError, errors.EtcdUnauthenticatedError)):
        return StoreDenied(f"{what}: {e}")
    if isinstance(e, (errors.EtcdConnectionError, errors.EtcdTransientError, TimeoutError)):
        return StoreUnavailable(f"{what}: {e or 'timed out'}")
    if isinstance(e, grpc.aio.AioRpcError):
        code, detail = e.code(), e.details() or ""
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or (
                "user name not found" in detail or "authentication failed" in detail):
            return StoreDenied(f"{what}: {code.name} {detail}")
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in detail:
            return LeaseExpired(f"{what}: {detail}")
        return StoreUnavailable(f"{what}: {code.name} {detail}")
    if isinstance(e, OSError):
        return StoreUnavailable(f"{what}: {e}")
    return None
