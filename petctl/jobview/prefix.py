"""A job's prefix as the read side sees it: named objects it can list and read.

The agents mirror each node's status, events and log there, and the job's result lands there too
(layout in petctl/agent/reporting.py); it outlives etcd, the instances and (on AWS) the job's stack.
Providers hand the read side a `PrefixReader`: the AWS provider its S3 `JobStore` (bound to the
provider's session, so region, profile and endpoint are the user's), the local provider a
`StorePrefix` on the job's directory (petctl.io.objstore's file store).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from petctl.core.mirrorchunks import ChunkKey, by_node
from petctl.io.objstore import FileStore, ObjectNotFound, ObjectStore


class PrefixReader(Protocol):
    """Read-only access to the objects under one job's prefix (names relative to the prefix)."""

    def get_bytes(self, name: str) -> bytes | None:
        """The object's bytes, or None when there is no such object. Raises PetctlError when the store
        cannot be read."""
        ...

    def list_keys(self, sub: str) -> list[str]:
        """Every object name under `<sub>/` (nested ones included), relative to the prefix, sorted."""
        ...


@dataclass(frozen=True)
class StorePrefix:
    """Any object store (petctl.io.objstore: `file://` or `s3://`) as a job prefix: the local provider's
    mirror directory, or an `s3://` URL opened without a provider session."""

    store: ObjectStore

    def get_bytes(self, name: str) -> bytes | None:
        try:
            return self.store.get_bytes(name)
        except ObjectNotFound:
            return None

    def list_keys(self, sub: str) -> list[str]:
        return [o.key for o in self.store.list(f"{sub}/")]


def file_prefix(root: Path) -> StorePrefix:
    """The job prefix in a local directory (the local provider's mirror)."""
    return StorePrefix(FileStore(root))


def chunks(reader: PrefixReader, stream: str) -> dict[str, list[ChunkKey]]:
    """node -> its `events` or `logs` chunks in write order (petctl/core/mirrorchunks.py)."""
    return by_node(reader.list_keys(stream), stream)


def chunk_text(reader: PrefixReader, keys: list[ChunkKey]) -> str:
    """One node's stream, reassembled: its chunks' bytes concatenated in write order, then decoded (a
    chunk may end inside a multi-byte character)."""
    return b"".join(reader.get_bytes(key.name) or b"" for key in keys).decode("utf-8", "replace")
