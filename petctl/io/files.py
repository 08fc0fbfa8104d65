"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Every write goes to a temporary file with a unique name in the target's directory (`mkstemp`), so two
threads or two processes writing the same path never share a temporary file; the last rename wins. A
failed write removes its temporary file and raises. Temporary names start with `.<name>.` and end with
`TMP_SUFFIX`, so a directory listing can tell them from real files (`is_temporary`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".part"


def is_temporary(name: str) -> bool:
    """Whether a file name is one of our in-flight temporaries (not a file anyone wrote yet)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


@contextlib.contextmanager
def atomic_writer(path: Path | str) -> Iterator[BinaryIO]:
    """A binary file that replaces `path` when the block ends without an exception.

    Parent directories are created. Raises OSError from the write or the rename (the target is then
    unchanged, the temporary gone)."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=TMP_SUFFIX, dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path | str, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) to `path` atomically. Raises OSError."""
    with atomic_writer(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def atomic_copy(src: Path | str, path: Path | str, chunk: int = 8 << 20) -> None:
    """Copy the file `src` to `path` atomically (streamed: large checkpoints never sit in memory).
    Raises FileNotFoundError when `src` is missing, OSError otherwise."""
    with open(src, "rb") as source, atomic_writer(path) as f:
        shutil.copyfileobj(source, f, chunk)
