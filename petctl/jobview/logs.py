"""Reading (and following) the node logs the agents mirror to the job's prefix, chunk by chunk."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from petctl.core.mirrorchunks import ChunkKey
from petctl.jobview.prefix import PrefixReader, chunk_text, chunks


def log_nodes(reader: PrefixReader) -> list[str]:
    """The nodes that have mirrored a log so far."""
    return list(chunks(reader, "logs"))


def follow_chunks(reader: PrefixReader, node: str | None, follow: bool, running: Callable[[], bool],
                  interval: float) -> Iterator[str]:
    """The node logs' lines from their chunks, in order (prefixed `[node] ` unless one node was asked for).

    Each chunk is fetched once, even with `follow`; a line split across two chunks is joined. With
    `follow`, new chunks (and new nodes) are read every `interval` seconds until `running()` is False.
    """
    nodes = [node] if node else log_nodes(reader)
    seen: dict[str, set[ChunkKey]] = {}  # node -> chunks already shown
    partial: dict[str, str] = {}  # node -> the unterminated tail of its last chunk
    while True:
        by_node = chunks(reader, "logs")
        for n in nodes:
            new = [k for k in by_node.get(n, []) if k not in seen.setdefault(n, set())]
            seen[n].update(new)
            lines = (partial.pop(n, "") + chunk_text(reader, new)).split("\n")
            partial[n] = lines.pop()  # "" when the text ended with a newline
            for line in (raw.rstrip("\r") for raw in lines):
                yield line if node else f"[{n}] {line}"
        if not follow or not running():
            for n, rest in partial.items():
                if rest:
                    yield rest if node else f"[{n}] {rest}"
            return
        time.sleep(interval)
        nodes = [node] if node else log_nodes(reader)
