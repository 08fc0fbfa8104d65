"""petctl.elastic: resumable, preemption-aware training state for scripts run by petctl (or torchrun).

    from petctl.elastic import State, Checkpointer
    state = State(model=model, optimizer=opt, extra={"step": 0})
    ckpt = Checkpointer(keep=3, every=50)      # $PETCTL_CHECKPOINT_URL: s3://... or file://...
    start = ckpt.resume(state)
    for step in range(start, total):
        ...
        if ckpt.step_end(step, state):
            break
    ckpt.close()

See docs/elastic.md. This package imports torch; the agent never imports it.
"""

from petctl.elastic.checkpointer import ENV_CHECKPOINT_URL, Checkpointer
from petctl.elastic.manifest import (
    Manifest,
    ObjectEntry,
    manifest_steps,
    prune,
    read_manifest,
    write_checkpoint,
)
from petctl.elastic.preemption import PreemptionMonitor
from petctl.elastic.state import State, Stateful
from petctl.elastic.store import (
    CheckpointStore,
    FileStore,
    ObjectInfo,
    ObjectNotFound,
    S3Options,
    S3Store,
    open_store,
)

__all__ = [
    "ENV_CHECKPOINT_URL",
    "Checkpointer",
    "CheckpointStore",
    "FileStore",
    "Manifest",
    "ObjectEntry",
    "ObjectInfo",
    "ObjectNotFound",
    "PreemptionMonitor",
    "S3Options",
    "S3Store",
    "State",
    "Stateful",
    "manifest_steps",
    "open_store",
    "prune",
    "read_manifest",
    "write_checkpoint",
]
