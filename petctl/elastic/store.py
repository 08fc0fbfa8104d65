"""Object stores for checkpoints: `file://` and `s3://`, addressed by keys under one base URL.

The stores are petctl's one object store (`petctl.io.objstore`), shared with the
agent and the CLI; this module keeps the names the checkpoint API has always had. A store only moves
bytes (put/get/list/delete); what makes a checkpoint complete or trustworthy is the manifest layer above
it (`manifest.py`). boto3 is imported only when an `s3://` store first transfers something.
"""

from __future__ import annotations

from petctl.io.objstore import (
           FileStore,
           ObjectInfo,
           ObjectNotFound,
           S3Options,
           S3Store,
           StoreError,
           open_store,
)
from petctl.io.objstore import ObjectStore as CheckpointStore

__all__ = ["CheckpointStore", "FileStore", "ObjectInfo", "ObjectNotFound", "S3Options", "S3Store",
           "StoreError", "open_store"]
