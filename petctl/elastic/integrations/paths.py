"""Where a framework's own checkpoints go under petctl: the job's checkpoint URL, as a directory.

The Trainer and Lightning write checkpoints to a file system path (`checkpoint-N/`, `last.ckpt`), and a
re-formed round must find the newest one, whichever node it ran on: so the directory must be one every
node sees. The agent passes the job's checkpoint location as `$PETCTL_CHECKPOINT_URL`; on the local
provider that is a `file://` directory every "instance" shares. Stdlib only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import unquote, urlparse

from petctl.elastic.checkpointer import ENV_CHECKPOINT_URL


def output_dir(default: str, subdir: str = "", environ: Mapping[str, str] | None = None) -> str:
    """`$PETCTL_CHECKPOINT_URL`'s directory (joined with `subdir`) when it is `file://`; `default` when
    the script runs outside petctl (plain torchrun).

    Raises ValueError for an `s3://` URL: a framework writes its checkpoints to a file system, and a
    directory on one node's disk is gone with that node. Give the script a path on a file system every
    node mounts (EFS, FSx) instead; `petctl.elastic.Checkpointer` is the way to checkpoint to S3."""
    url = (os.environ if environ is None else environ).get(ENV_CHECKPOINT_URL, "")
    if not url:
        return default
    parsed = urlparse(url)
    if parsed.scheme != "file":
        raise ValueError(f"{ENV_CHECKPOINT_URL}={url}: framework checkpoints need a directory every node "
                         "shares (file://, or a path on EFS/FSx), not a per-node disk or S3")
    return os.path.join(unquote(parsed.path), subdir) if subdir else unquote(parsed.path)
