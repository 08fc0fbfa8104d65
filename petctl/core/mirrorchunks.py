"""The append-only chunk layout of the agents' event and log mirror, shared by the writer (the agent's
reporting.py) and every reader (petctl/jobview/prefix.py: node logs and events, over any object store).

Why chunks: rewriting a node's whole events file and a 4 MB log tail every 10 s into a versioned bucket
stores every copy as a noncurrent version (hundreds of GB per node over a long job). Instead each upload
holds only what is new since the last one, under a key that sorts in write order:

    events/<node>/<epoch_ms:013d>-<seq:08d>.jsonl    the event lines added since the previous chunk
    logs/<node>/<epoch_ms:013d>-<seq:08d>.log        the log bytes appended since the previous chunk

`epoch_ms` is when the writing agent process started, so a restarted agent (same node id) never
overwrites its predecessor's chunks; `seq` counts that process's chunks. Concatenating a node's chunks in
name order gives back exactly what was written. The older one-object layout (`events/<node>.jsonl`,
`logs/<node>.log`) is still read, so jobs mirrored by older agents stay readable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STREAMS = {"events": ".jsonl", "logs": ".log"}
CHUNK_RE = re.compile(r"^(?P<stream>events|logs)/(?P<node>[^/]+)/(?P<epoch>\d{13})-(?P<seq>\d{8})"
                      r"(?P<suffix>\.jsonl|\.log)$")
LEGACY_RE = re.compile(r"^(?P<stream>events|logs)/(?P<node>[^/]+?)(?P<suffix>\.jsonl|\.log)$")


@dataclass(frozen=True, order=True)
class ChunkKey:
    """One chunk's name relative to the job's mirror prefix. Orders as it was written (per node)."""

    stream: str
    node: str
    epoch_ms: int  # the writing process's start time: -1 for a legacy single object (read first)
    seq: int

    @property
    def name(self) -> str:
        if self.epoch_ms < 0:
            return f"{self.stream}/{self.node}{STREAMS[self.stream]}"
        return f"{self.stream}/{self.node}/{self.epoch_ms:013d}-{self.seq:08d}{STREAMS[self.stream]}"

    @classmethod
    def parse(cls, name: str) -> ChunkKey | None:
        """The chunk a relative key names, or None for anything else under the prefix."""
        match = CHUNK_RE.match(name)
        if match and STREAMS[match["stream"]] == match["suffix"]:
            return cls(match["stream"], match["node"], int(match["epoch"]), int(match["seq"]))
        match = LEGACY_RE.match(name)
        if match and STREAMS[match["stream"]] == match["suffix"]:
            return cls(match["stream"], match["node"], -1, 0)
        return None


def chunk_name(stream: str, node: str, epoch_ms: int, seq: int) -> str:
    if stream not in STREAMS:
        raise ValueError(f"unknown mirror stream {stream!r} (one of {', '.join(STREAMS)})")
    return ChunkKey(stream, node, epoch_ms, seq).name


def by_node(names: list[str], stream: str) -> dict[str, list[ChunkKey]]:
    """node -> its chunks of `stream` in write order (names that are not chunks are ignored)."""
    out: dict[str, list[ChunkKey]] = {}
    for name in names:
        key = ChunkKey.parse(name)
        if key is not None and key.stream == stream:
            out.setdefault(key.node, []).append(key)
    return {node: sorted(keys) for node, keys in sorted(out.items())}
