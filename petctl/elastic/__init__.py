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

See docs/elastic.md. The checkpointers import torch (on first use of a name that needs it); the agent
never imports this package: it shares the object store through `petctl.io.objstore`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Name -> the module defining it (relative to petctl.elastic, or a full name for the object store the
# checkpoint API shares with the agent: `CheckpointStore` is `petctl.io.objstore.ObjectStore`). Loaded on
# first access (PEP 562), so `import petctl.elastic.manifest` or
# `from petctl.elastic import open_object_store` never pays for torch; `from petctl.elastic import
# Checkpointer` loads what it needs.
_EXPORTS = {
    "ENV_CHECKPOINT_URL": "checkpointer",
    "BatchPlan": "sampler",
    "Checkpointer": "checkpointer",
    "ElasticSampler": "sampler",
    "endless": "sampler",
    "Manifest": "manifest",
    "ObjectEntry": "manifest",
    "manifest_steps": "manifest",
    "prune": "manifest",
    "read_manifest": "manifest",
    "write_checkpoint": "manifest",
    "SaveNowMonitor": "workerprotocol",
    "ShardedCheckpointer": "sharded",
    "ShardedState": "state",
    "State": "state",
    "Stateful": "state",
    "CheckpointStore": "manifest",
    "FileStore": "petctl.io.objstore",
    "ObjectInfo": "petctl.io.objstore",
    "ObjectNotFound": "petctl.io.objstore",
    "S3Options": "petctl.io.objstore",
    "S3Store": "petctl.io.objstore",
    "SnapshotOptions": "snapshots",
    "open_object_store": "petctl.io.objstore",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'petctl.elastic' has no attribute {name!r}")
    full = module if module.startswith("petctl.") else f"petctl.elastic.{module}"
    value = getattr(importlib.import_module(full), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

