"""The `s3://bucket/prefix` backend of the object store (`petctl.io.objstore`).

Large objects use boto3's managed transfers (multipart, parallel parts, `S3Options`). The client comes
from `petctl.io.aws.client(..., profile="data")` (S3's 503 SlowDown on a hot prefix is ridden out there)
and is built on first use, so opening a store costs nothing and a missing credential is a failure of the
first transfer (an OSError its caller already handles), not of the constructor. boto3 loads with it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from petctl.io.aws import client as aws_client
from petctl.io.aws import error_code, error_message
from petctl.io.objstore import ObjectInfo, ObjectNotFound, ObjectStore, StoreError, check_key

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
        """botocore/boto3 failures as OSErrors: ObjectNotFound for a missing key, StoreError otherwise."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            code = error_code(exc)
            if key and code in NOT_FOUND:
                raise ObjectNotFound(key) from exc
            raise StoreError(f"cannot {action} {self.url}/{key}: {code}: {error_message(exc)}", code) from exc
        except (BotoCoreError, Boto3Error) as exc:  # no credentials, no network, a failed multipart upload
            raise StoreError(f"cannot {action} {self.url}/{key}: {type(exc).__name__}: {exc}") from exc

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
