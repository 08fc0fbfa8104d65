"""python-etcd's answers and failures as the v2 store backend's (v2.py, v2lease.py, v2watch.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import etcd

from petctl.core.store import Entry, StoreDenied, StoreError, StoreUnavailable
from petctl.io.etcd import store_errors


def denied(e: etcd.EtcdException) -> bool:
    payload = e.payload if isinstance(e.payload, dict) else {}
    return isinstance(e, etcd.EtcdInsufficientPermissions) or payload.get("status") in (401, 403)


@contextlib.contextmanager
def errors(what: str) -> Iterator[None]:
    """python-etcd's failures as the store's: no permission → StoreDenied, anything else → StoreUnavailable.
    Answers etcd gives on purpose (key not found, compare failed) are handled by the callers first."""
    try:
        yield
    except StoreError:
        raise  # already the store's (Compacted, LeaseExpired): store_errors() below includes StoreError
    except etcd.EtcdException as e:
        if denied(e):
            raise StoreDenied(f"{what}: {e}") from e
        raise StoreUnavailable(f"{what}: {e}") from e
    except store_errors() as e:
        raise StoreUnavailable(f"{what}: {e}") from e


def index(e: etcd.EtcdException) -> int:
    """The etcd index an error answer carries (every v2 error body has one)."""
    payload = e.payload if isinstance(e.payload, dict) else {}
    return int(payload.get("index") or 0)


def dirpath(directory: str) -> str:
    """A directory as v2 requests name it: with its trailing slash, because a job's v2 role grants
    `/petctl/jobs/<job>/*`, which `/petctl/jobs/<job>/` matches and `/petctl/jobs/<job>` does not."""
    return directory.rstrip("/") + "/"


def entry(node, lease: int = 0) -> Entry:
    return Entry(key=node.key, value=node.value if node.value is not None else "",
                 mod_revision=int(node.modifiedIndex), create_revision=int(node.createdIndex), lease=lease)
