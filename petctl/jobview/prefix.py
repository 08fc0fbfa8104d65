"""A job's prefix as the read side sees it: named objects it can list and read.

The agents mirror each node's status, events and log there, and the job's result lands there too
(layout in petctl/agent/mirror.py); it outlives etcd, the instances and (on AWS) the job's stack.
Providers hand the read side a `PrefixReader`: the AWS provider its S3 `JobStore` (bound to the
provider's session, so region, profile and endpoint are the user's), the local provider a `FilePrefix`
on the job's directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from petctl.core.mirrorchunks import ChunkKey, by_node


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
class FilePrefix:
    """A job prefix on the local file system (`file://`): the local provider's mirror directory."""

    root: Path

    def get_bytes(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def list_keys(self, sub: str) -> list[str]:
        base = self.root / sub
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())


def chunks(reader: PrefixReader, stream: str) -> dict[str, list[ChunkKey]]:
    """node -> its `events` or `logs` chunks in write order (petctl/core/mirrorchunks.py)."""
    return by_node(reader.list_keys(stream), stream)


def chunk_text(reader: PrefixReader, keys: list[ChunkKey]) -> str:
    """One node's stream, reassembled: its chunks' bytes concatenated in write order, then decoded (a
    chunk may end inside a multi-byte character)."""
    return b"".join(reader.get_bytes(key.name) or b"" for key in keys).decode("utf-8", "replace")
