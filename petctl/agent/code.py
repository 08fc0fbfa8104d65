"""Bring the job's code onto the node: a file or directory (file://), or an object in S3 (s3://).

A directory uploaded to S3 travels as a .tar.gz archive and is unpacked here (with tarfile's `data`
filter where available, so an archive can't write outside the code dir). boto3 is imported only for
s3:// URLs; it honours AWS_ENDPOINT_URL, which is how the tests point it at the emulator.
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path
from urllib.parse import unquote, urlparse


def fetch_code(code_url: str, dest: Path) -> Path:
    """Materialise the code under `dest` (replaced if present); returns `dest`."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    u = urlparse(code_url)
    if u.scheme in ("", "file"):
        src = Path(unquote(u.path) if u.scheme else code_url)
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True)
        elif _is_archive(src.name):
            _unpack(src, dest)
        else:
            shutil.copy2(src, dest / src.name)
        return dest
    if u.scheme == "s3":
        import boto3

        name = Path(u.path).name
        local = dest.parent / f".{dest.name}.{name}"
        boto3.client("s3").download_file(u.netloc, u.path.lstrip("/"), str(local))
        if _is_archive(name):
            _unpack(local, dest)
            local.unlink()
        else:
            local.replace(dest / name)
        return dest
    raise ValueError(f"unsupported code URL {code_url!r} (use file:// or s3://)")


def _is_archive(name: str) -> bool:
    return name.endswith((".tar.gz", ".tgz"))


def _unpack(archive: Path, dest: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.10.12: refuse absolute paths and '..' ourselves
            for member in tar.getmembers():
                target = (dest / member.name).resolve()
                if not str(target).startswith(str(dest.resolve())):
                    raise ValueError(f"archive member escapes the code dir: {member.name}")
            tar.extractall(dest)
