"""Worker side of fencing: no checkpoint is committed while the agent says this node may be cut off.

An agent that lost etcd while its workers stalled cannot know whether the others re-formed without it.
It writes `<PETCTL_CONTROL_DIR>/fenced` (`petctl.core.controlfiles`); from then on a save of this node's
workers must not become visible to a loader: the survivors may already be training on from an older
checkpoint, and a manifest from the cut-off node would put its stale lineage in front of theirs.

The checkpointers ask `CommitFence.blocks(step)` twice per save: before any byte is uploaded (a fenced
node writes nothing) and right before the manifest, the commit itself (a background upload that started
before the fence and ends after it is dropped there). A stat each time, no parsing unless fenced.

One `checkpoint.fenced` event when a fence is first seen, one `checkpoint.unfenced` (with how many saves
were skipped) at the first save allowed after it was lifted; `skipped` counts every skipped commit.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from petctl.core import controlfiles
from petctl.core.eventlog import EventLog


class CommitFence:
    """Whether a save may commit now; thread-safe (the background uploader asks it too)."""

    def __init__(self, control_dir: Path | None, log: EventLog, url: str) -> None:
        self.control_dir = control_dir
        self.log = log
        self.url = url
        self.skipped = 0  # commits skipped because of a fence, over this checkpointer's life
        self._lock = threading.Lock()
        self._since: float | None = None  # when the current fence was first seen; None: not fenced
        self._skipped_in_fence = 0

    def blocks(self, step: int, stage: str) -> bool:
        """True (and the skip counted, reported once per fence) when the save of `step` must not go on.

        `stage` says where the save was stopped ("upload" before any byte, "commit" before the manifest).
        """
        fenced = controlfiles.fenced(self.control_dir)
        with self._lock:
            if fenced:
                self.skipped += 1
                self._skipped_in_fence += 1
                if self._since is None:
                    self._since = time.time()
                    self.log.emit("checkpoint.fenced", step=step, stage=stage, url=self.url,
                                  **_fence_info(self.control_dir))
                return True
            if self._since is not None:
                self.log.emit("checkpoint.unfenced", step=step, skipped=self._skipped_in_fence,
                              seconds=round(time.time() - self._since, 3), url=self.url)
                self._since, self._skipped_in_fence = None, 0
            return False


def _fence_info(control_dir: Path | None) -> dict[str, Any]:
    """The agent's note in the fence file (round, reason) for the event; {} when it cannot be read."""
    if control_dir is None:
        return {}
    try:
        data = json.loads(controlfiles.fence_path(control_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # removed or half there: the event goes out without the details
        return {}
    if not isinstance(data, dict):
        return {}
    return {"fence_round": data.get("round"), "reason": data.get("reason")}
