"""Bring the job's code onto the node: a file or directory (file://), or an object in S3 (s3://).

A directory uploaded to S3 travels as a .tar.gz archive and is unpacked here (with tarfile's `data`
filter where available, so an archive can't write outside the code dir). An object is downloaded through
`petctl.io.objstore` (boto3 loads for s3:// only; it honours AWS_ENDPOINT_URL, which is how the tests
point it at the emulator).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from petctl.io.objstore import local_path, open_parent


def fetch_code(code_url: str, dest: Path) -> Path:
    """Materialise the code under `dest` (replaced if present); returns `dest`.

    Raises ObjectNotFound or StoreError (OSErrors) when the object cannot be read, ValueError for an
    unsupported URL or an archive member that would land outside `dest`."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    src = local_path(code_url)
    if src is not None:
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True)
        elif _is_archive(src.name):
            _unpack(src, dest)
        else:
            shutil.copy2(src, dest / src.name)
        return dest
    store, name = open_parent(code_url)
    local = dest.parent / f".{dest.name}.{name}"
    store.get_file(name, local)
    if _is_archive(name):
        _unpack(local, dest)
        local.unlink()
    else:
        local.replace(dest / name)
    return dest


def _is_archive(name: str) -> bool:
    return name.endswith((".tar.gz", ".tgz"))


def _unpack(archive: Path, dest: Path) -> None:
    import tarfile  # only a job whose code is an archive needs it: not loaded by every agent at start

    with tarfile.open(archive, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.10.12: refuse absolute paths and '..' ourselves
            for member in tar.getmembers():
                target = (dest / member.name).resolve()
                if not str(target).startswith(str(dest.resolve())):
                    raise ValueError(f"archive member escapes the code dir: {member.name}")
            tar.extractall(dest)
