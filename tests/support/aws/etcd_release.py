"""Fake etcd releases for `setup` against moto: tiny binaries that pass its linux-x86_64 check, a tarball
laid out as etcd's releases are, the loopback mirror that serves one, and the options that ship the fake."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def fake_etcd_binary(directory: Path) -> Path:
    """A tiny file that passes setup's linux-x86_64 check (the real etcd is 23 MB per upload)."""
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    header[18:20] = (0x3E).to_bytes(2, "little")
    path = directory / "fake-etcd"
    path.write_bytes(bytes(header) + b"fake etcd for tests\n")
    path.with_name("etcdctl").write_bytes(bytes(header) + b"fake etcdctl for tests\n")  # shipped next to it
    return path


def fake_etcd_tarball(directory: Path, version: str, members: tuple[str, ...] = ("etcd", "etcdctl")) -> Path:
    """A tarball laid out as etcd's releases are (`etcd-<v>-linux-amd64/` with etcd, etcdctl, README.md),
    its executables tiny fakes that pass setup's linux-x86_64 check."""
    import io
    import tarfile

    binaries = fake_etcd_binary(directory)
    folder = f"etcd-{version}-linux-amd64"
    path = directory / f"{folder}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        contents = {"etcd": binaries.read_bytes(), "etcdctl": binaries.with_name("etcdctl").read_bytes(),
                    "README.md": b"etcd\n"}
        for name in (*members, "README.md"):
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size, info.mode = len(contents[name]), 0o755
            archive.addfile(info, io.BytesIO(contents[name]))
    return path


@dataclass
class EtcdMirror:
    """A loopback server laid out like etcd's GitHub releases (`<url>/<version>/<tarball>`)."""

    url: str
    root: Path
    requests: list[str]
    release: Any = None  # the EtcdRelease petctl pins for store=v3 while the fixture runs
    releases: dict[str, Any] = field(default_factory=dict)  # "v3.6"/"v3.5" -> the EtcdRelease served
    etcd_sha256: str = ""  # the fake binaries inside its tarball
    etcdctl_sha256: str = ""

    def publish(self, tarball: Path, version: str) -> str:
        """Serve `tarball` as `version`'s; its SHA-256."""
        (self.root / version).mkdir(parents=True, exist_ok=True)
        data = tarball.read_bytes()
        (self.root / version / tarball.name).write_bytes(data)
        return hashlib.sha256(data).hexdigest()


def fake_etcd_options(directory: Path) -> dict[str, str]:
    """setup's options that ship the fake etcd: the binary and the hash the operator vouches for (petctl
    ships only a binary whose hash is pinned or given)."""
    path = fake_etcd_binary(directory)
    return {"etcd_binary": str(path), "etcd_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "etcdctl_sha256": hashlib.sha256(path.with_name("etcdctl").read_bytes()).hexdigest()}
