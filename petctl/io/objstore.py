"""Bytes under a `file://` or `s3://` URL, addressed by keys relative to it: the one object store.

Checkpoints (`petctl.elastic`), the agent's mirror of status/events/logs, the job's code and agent config,
and the CLI's read side all go through these classes, so "put these bytes there" is written once per
backend. A store only moves bytes (put/get/list/delete); what makes a checkpoint complete is the manifest
layer above it, and what a key means is its caller's business.

Every failure to reach the backend is an `OSError`: `ObjectNotFound` (also a `FileNotFoundError`) for a
missing key, `ObjectStoreError` for the rest (on S3: credentials, access, throttling, the network, with the
AWS error code in `code`). Callers catch `OSError` and need not know the backend; a key that is not a
valid relative path, or an unsupported URL, is a `ValueError`.

    <url>/<key>        keys are '/'-separated relative paths; '.' and '..' are refused

The `s3://bucket/prefix` backend (`S3Store`): large objects use boto3's managed transfers (multipart,
parallel parts, `S3Options`). The client comes from `petctl.io.aws.client(..., profile="data")` (S3's
503 SlowDown on a hot prefix is ridden out there) and is built on first use, so opening a store costs
nothing and a missing credential is a failure of the first transfer (an OSError its caller already
handles), not of the constructor. boto3 loads with that client, not with this module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from petctl.core.errors import ObjectStoreError
from petctl.io.aws import client as aws_client
from petctl.io.aws import error_code, error_message
from petctl.io.files import atomic_copy, atomic_write, is_temporary


class ObjectNotFound(FileNotFoundError):
    """The key does not exist in the store."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's base URL, '/'-separated
    size: int
    mtime: float = 0.0  # unix seconds of the last write (0.0 where the backend did not say)


class ObjectStore(ABC):
    """Bytes under a base URL. Keys are relative, '/'-separated paths; implementations are thread-safe.

    Subclasses implement the six abstract methods; `stat`, `subdirs` and `purge` have portable defaults
    built on them that a backend may override with something cheaper."""

    url: str

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (large objects: streamed, multipart on S3). Raises OSError."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, content_type: str = "") -> None:
        """Store `data` at `key` (replacing it whole: a reader never sees half). Raises OSError."""

    @abstractmethod
    def get_file(self, key: str, path: Path) -> None:
        """Download to a local path. Raises ObjectNotFound, or ObjectStoreError."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Raises ObjectNotFound, or ObjectStoreError."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key. Raises ObjectStoreError."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete keys; missing keys are not an error (retention may race a restarted writer)."""

    def stat(self, key: str) -> ObjectInfo | None:
        """The object at exactly `key`, or None."""
        return next((o for o in self.list(key) if o.key == key), None)

    def subdirs(self, prefix: str = "") -> list[str]:
        """Names of the 'directories' directly under `prefix` (which ends with '/' or is empty)."""
        rests = [o.key[len(prefix):] for o in self.list(prefix)]
        return sorted({rest.split("/", 1)[0] for rest in rests if "/" in rest} - {""})

    def purge(self, prefix: str) -> None:
        """Remove every object under `prefix`, with every stored version where the backend keeps them."""
        self.delete([o.key for o in self.list(prefix)])


def check_key(key: str) -> list[str]:
    """The key's path parts. Raises ValueError for an empty key, or one with '.' or '..' parts."""
    parts = [p for p in key.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"invalid store key {key!r}")
    return parts


class FileStore(ObjectStore):
    """A directory. Writes go to a unique temporary name beside the target and are renamed into place
    (`petctl.io.files`), so concurrent writers of one key never share a temporary file."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.url = self.root.resolve().as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key))

    def put_file(self, key: str, path: Path) -> None:
        atomic_copy(path, self._path(key))

    def put_bytes(self, key: str, data: bytes, content_type: str = "") -> None:
        atomic_write(self._path(key), data)

    def get_file(self, key: str, path: Path) -> None:
        try:
            shutil.copyfile(self._path(key), path)
        except FileNotFoundError as e:
            if not self._path(key).is_file():
                raise ObjectNotFound(key) from e
            raise  # the destination's directory is missing: the caller's mistake, not a missing key

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError) as e:
            raise ObjectNotFound(key) from e

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if is_temporary(name):  # in-flight writes are not objects
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            self._prune_dirs(path.parent)

    def _prune_dirs(self, parent: Path) -> None:
        """Remove the empty directories a delete left, up to the root (step directories go with their
        last object)."""
        while parent != self.root and parent.is_dir():
            try:
                parent.rmdir()
            except OSError:  # not empty: what is left above is in use too
                break
            parent = parent.parent

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def subdirs(self, prefix: str = "") -> list[str]:
        base = self.root.joinpath(*prefix.split("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir())


def local_path(url: str) -> Path | None:
    """The local path a `file://` URL or a plain path names; None for any other scheme.
    Raises ValueError for a `file://` URL with a host."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL with a host is not supported: {url!r}")
        return Path(unquote(parsed.path))
    if parsed.scheme == "":
        return Path(url)
    return None


def open_object_store(url: str, s3: S3Options | None = None) -> ObjectStore:
    """The store for a URL: `s3://bucket/prefix`, `file:///abs/dir`, or a plain local path.
    Raises ValueError for any other scheme."""
    path = local_path(url)
    if path is not None:
        return FileStore(path)
    if urlparse(url).scheme == "s3":
        return S3Store(url, s3)
    raise ValueError(f"unsupported URL {url!r}: use s3://bucket/prefix or file:///path")


def open_parent(url: str) -> tuple[ObjectStore, str]:
    """The store holding the single object `url` names, and its key there (`s3://b/p/x.json` ->
    (the store of `s3://b/p`, "x.json")). Raises ValueError for an unsupported URL or one naming no
    object."""
    path = local_path(url)
    if path is not None:
        if not path.name:
            raise ValueError(f"not the URL of an object: {url!r}")
        return FileStore(path.parent), path.name
    parsed = urlparse(url)
    key = parsed.path.strip("/")
    if parsed.scheme != "s3" or not parsed.netloc or not key:
        raise ValueError(f"not the URL of an object: {url!r} (use s3://bucket/key or a file path)")
    head, _, name = key.rpartition("/")
    return S3Store(f"s3://{parsed.netloc}/{head}".rstrip("/")), name


def read_url(url: str) -> bytes:
    """The bytes of the object `url` names (a path, `file://` or `s3://`). Raises ObjectNotFound,
    ObjectStoreError, or ValueError."""
    store, key = open_parent(url)
    return store.get_bytes(key)


# --- the s3:// backend ------------------------------------------------------------------------------
NOT_FOUND = ("NoSuchKey", "404", "NotFound")
DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys


@dataclass
class S3Options:
    """Transfer knobs. 16 MiB parts uploaded 10 at a time keep S3 busy and allow objects up to 160 GB
    (10,000 parts); tests shrink the threshold to exercise multipart on small objects."""

    multipart_threshold: int = 32 << 20
    multipart_chunksize: int = 16 << 20
    max_concurrency: int = 10
    region: str | None = None  # default: $AWS_REGION, $AWS_DEFAULT_REGION, the profile's
    endpoint_url: str | None = None  # default: $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL


class S3Store(ObjectStore):
    """`s3://bucket/prefix`. `client`: a boto3 S3 client to use instead of building one (the CLI passes
    its session's, which knows the user's profile, region and endpoint)."""

    def __init__(self, url: str, options: S3Options | None = None, client: Any = None) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an s3:// URL: {url!r}")
        self.url = url.rstrip("/")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.options = options or S3Options()
        self._client = client
        self._transfer: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The boto3 client (built once, on first use; boto3 clients are thread-safe)."""
        with self._lock:
            if self._client is None:
                region = (self.options.region or os.environ.get("AWS_REGION")
                          or os.environ.get("AWS_DEFAULT_REGION") or "")
                self._client = aws_client("s3", profile="data", region=region,
                                          endpoint_url=self.options.endpoint_url or "",
                                          max_pool_connections=max(10, self.options.max_concurrency + 2))
            return self._client

    @property
    def transfer(self) -> Any:
        """boto3's TransferConfig for managed (multipart) uploads and downloads."""
        if self._transfer is None:
            from boto3.s3.transfer import TransferConfig

            self._transfer = TransferConfig(multipart_threshold=self.options.multipart_threshold,
                                            multipart_chunksize=self.options.multipart_chunksize,
                                            max_concurrency=self.options.max_concurrency)
        return self._transfer

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextlib.contextmanager
    def _errors(self, action: str, key: str = "") -> Iterator[None]:
        """botocore/boto3 failures as OSErrors: ObjectNotFound for a missing key, ObjectStoreError
        otherwise."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            code = error_code(exc)
            if key and code in NOT_FOUND:
                raise ObjectNotFound(key) from exc
            message = f"cannot {action} {self.url}/{key}: {code}: {error_message(exc)}"
            raise ObjectStoreError(message, code) from exc
        except (BotoCoreError, Boto3Error) as exc:  # no credentials, no network, a failed multipart upload
            raise ObjectStoreError(f"cannot {action} {self.url}/{key}: {type(exc).__name__}: {exc}") from exc

    def put_file(self, key: str, path: Path) -> None:
        full = self._key(key)
        with self._errors("upload to", key):
            self.client.upload_file(str(path), self.bucket, full, Config=self.transfer)

    def put_bytes(self, key: str, data: bytes, content_type: str = "") -> None:
        extra = {"ContentType": content_type} if content_type else {}
        full = self._key(key)
        with self._errors("write", key):
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data, **extra)

    def get_file(self, key: str, path: Path) -> None:
        full = self._key(key)
        with self._errors("download", key):
            self.client.download_file(self.bucket, full, str(path), Config=self.transfer)

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        with self._errors("read", key):
            return self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        out = []
        with self._errors("list", prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                               Prefix=base + prefix):
                out += [ObjectInfo(obj["Key"][len(base):], int(obj["Size"]), obj["LastModified"].timestamp())
                        for obj in page.get("Contents", [])]
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        full = [self._key(k) for k in keys]
        with self._errors("delete from"):
            for i in range(0, len(full), DELETE_BATCH):
                batch = [{"Key": k} for k in full[i:i + DELETE_BATCH]]
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def stat(self, key: str) -> ObjectInfo | None:
        full = self._key(key)
        try:
            with self._errors("look up", key):
                head = self.client.head_object(Bucket=self.bucket, Key=full)
        except ObjectNotFound:
            return None
        return ObjectInfo(key, int(head["ContentLength"]), head["LastModified"].timestamp())

    def subdirs(self, prefix: str = "") -> list[str]:
        base = (f"{self.prefix}/" if self.prefix else "") + prefix
        names = []
        with self._errors("list", prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base,
                                                                               Delimiter="/"):
                names += [p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(n for n in names if n)

    def purge(self, prefix: str) -> None:
        """Every version and delete marker under `prefix` (a versioned bucket keeps old ones otherwise)."""
        base = (f"{self.prefix}/" if self.prefix else "") + prefix
        with self._errors("purge", prefix):
            for page in self.client.get_paginator("list_object_versions").paginate(Bucket=self.bucket,
                                                                                    Prefix=base):
                objects = [{"Key": v["Key"], "VersionId": v["VersionId"]}
                           for v in page.get("Versions", []) + page.get("DeleteMarkers", [])]
                for i in range(0, len(objects), DELETE_BATCH):
                    self.client.delete_objects(Bucket=self.bucket,
                                               Delete={"Objects": objects[i:i + DELETE_BATCH], "Quiet": True})
