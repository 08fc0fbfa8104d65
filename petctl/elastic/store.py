"""Object stores for checkpoints: `file://` and `s3://`, addressed by keys under one base URL.

A store only moves bytes (put/get/list/delete); what makes a checkpoint complete or trustworthy is the
manifest layer above it (`manifest.py`). Keeping the store dumb means a new backend is four methods.
boto3 is imported only when an `s3://` store is created, so file-only users and tests don't need it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


class ObjectNotFound(FileNotFoundError):
    """The key does not exist in the store."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's base URL, '/'-separated
    size: int


class CheckpointStore(ABC):
    """Bytes under a base URL. Keys are relative, '/'-separated paths; implementations are thread-safe."""

    url: str

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (large objects: streamed, multipart on S3)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_file(self, key: str, path: Path) -> None:
        """Download to a local path; raises ObjectNotFound."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Raises ObjectNotFound."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete keys; missing keys are not an error (retention may race a restarted writer)."""


class FileStore(CheckpointStore):
    """A directory. Writes go to a temporary name in the target directory and are renamed into place."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.url = self.root.resolve().as_uri()

    def _path(self, key: str) -> Path:
        parts = [p for p in key.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"invalid store key {key!r}")
        return self.root.joinpath(*parts)

    def _atomic(self, key: str, write: Any) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: Path) -> None:
        def write(f: Any) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, f, 8 << 20)

        self._atomic(key, write)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic(key, lambda f: f.write(data))

    def get_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        try:
            shutil.copyfile(src, path)
        except FileNotFoundError as e:
            raise ObjectNotFound(key) from e

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as e:
            raise ObjectNotFound(key) from e

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(".") and name.endswith(".part"):  # in-flight writes are not objects
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        out.append(ObjectInfo(key, full.stat().st_size))
                    except FileNotFoundError:
                        continue
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parent = path.parent
            while parent != self.root and parent.is_dir():
                try:
                    parent.rmdir()  # only empty step directories go
                except OSError:
                    break
                parent = parent.parent


@dataclass
class S3Options:
    """Transfer knobs. 16 MiB parts uploaded 10 at a time keep S3 busy and allow objects up to 160 GB
    (10,000 parts); tests shrink the threshold to exercise multipart on small objects."""

    multipart_threshold: int = 32 << 20
    multipart_chunksize: int = 16 << 20
    max_concurrency: int = 10
    region: str | None = None
    endpoint_url: str | None = None  # default: $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL


class S3Store(CheckpointStore):
    """`s3://bucket/prefix`. Large objects use boto3's managed (multipart, parallel) transfers."""

    def __init__(self, url: str, options: S3Options | None = None, client: Any = None) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an s3:// URL: {url!r}")
        self.url = url.rstrip("/")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.options = options or S3Options()
        self._client = client if client is not None else self._make_client()
        from boto3.s3.transfer import TransferConfig

        self._transfer = TransferConfig(
            multipart_threshold=self.options.multipart_threshold,
            multipart_chunksize=self.options.multipart_chunksize,
            max_concurrency=self.options.max_concurrency,
        )

    def _make_client(self) -> Any:
        import boto3
        from botocore.config import Config

        endpoint = (self.options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                    or os.environ.get("AWS_ENDPOINT_URL") or None)
        region = (self.options.region or os.environ.get("AWS_REGION")
                  or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
        config = Config(retries={"max_attempts": 5, "mode": "standard"},
                        max_pool_connections=max(10, self.options.max_concurrency + 2))
        return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region,
                                              config=config)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    @staticmethod
    def _not_found(error: Exception) -> bool:
        code = str(getattr(error, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("NoSuchKey", "404", "NotFound")

    def put_file(self, key: str, path: Path) -> None:
        self._client.upload_file(str(path), self.bucket, self._key(key), Config=self._transfer)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_file(self, key: str, path: Path) -> None:
        from botocore.exceptions import ClientError

        try:
            self._client.download_file(self.bucket, self._key(key), str(path), Config=self._transfer)
        except ClientError as e:
            if self._not_found(e):
                raise ObjectNotFound(key) from e
            raise

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as e:
            if self._not_found(e):
                raise ObjectNotFound(key) from e
            raise

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        out = []
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
            for obj in page.get("Contents", []):
                out.append(ObjectInfo(obj["Key"][len(base):], int(obj["Size"])))
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            if batch:
                self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})


def open_store(url: str, s3: S3Options | None = None) -> CheckpointStore:
    """The store for a checkpoint URL: `s3://bucket/prefix`, `file:///abs/dir`, or a plain local path."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        return S3Store(url, s3)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL with a host is not supported: {url!r}")
        return FileStore(unquote(parsed.path))
    if parsed.scheme == "":
        return FileStore(url)
    raise ValueError(f"unsupported checkpoint URL {url!r}: use s3://bucket/prefix or file:///path")
