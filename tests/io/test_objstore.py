"""The one object store (petctl/io/objstore.py: file and S3 backends) on a directory and on moto S3 (loopback)
HTTP, and what is built on it: the agent's config and code download, the AWS error mapping."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest

from petctl.core.errors import NotSetUp, ProviderError
from petctl.core.spec import AgentConfig, JobSpec
from petctl.io.aws import aws_errors
from petctl.io.objstore import (
    FileStore,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    S3Store,
    open_object_store,
    open_parent,
    read_url,
)
from tests.support.paths import REPO


@pytest.fixture
def store(checkpoint_url: str) -> ObjectStore:
    return open_object_store(checkpoint_url)


def test_layout_operations_on_both_backends(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "blob"
    src.write_bytes(b"y" * 300)
    store.put_file("jobs/a/code/train.py", src)
    store.put_bytes("jobs/a/status/n1.json", b'{"s": 1}', "application/json")
    store.put_bytes("jobs/b/job.json", b"{}")
    store.put_bytes("jobs/b/job.json", b'{"v": 2}')  # replaced whole
    assert [(o.key, o.size) for o in store.list("jobs/")] == [
        ("jobs/a/code/train.py", 300), ("jobs/a/status/n1.json", 8), ("jobs/b/job.json", 8)]
    assert all(o.mtime > 1e9 for o in store.list())  # a real timestamp on both backends
    assert store.subdirs("jobs/") == ["a", "b"] and store.subdirs("jobs/a/") == ["code", "status"]
    assert store.subdirs("nothing/") == []
    info = store.stat("jobs/b/job.json")
    assert info is not None and info.size == 8 and store.stat("jobs/b/nope.json") is None
    assert store.get_bytes("jobs/b/job.json") == b'{"v": 2}'
    out = tmp_path / "out"
    store.get_file("jobs/a/code/train.py", out)
    assert out.read_bytes() == b"y" * 300
    store.purge("jobs/a/")
    assert [o.key for o in store.list()] == ["jobs/b/job.json"]
    with pytest.raises(ObjectNotFound):
        store.get_bytes("jobs/a/status/n1.json")
    with pytest.raises(ObjectNotFound):
        store.get_file("jobs/a/code/train.py", out)
    with pytest.raises(ValueError):
        store.put_bytes("jobs/../escape", b"")


def test_s3_failures_are_oserrors_with_the_aws_code(moto_env: str, tmp_path: Path) -> None:
    missing = S3Store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p")
    with pytest.raises(ObjectStoreError) as failure:
        missing.put_bytes("k", b"x")
    assert isinstance(failure.value, OSError) and failure.value.code == "NoSuchBucket"
    assert "no-such-bucket" in str(failure.value)
    src = tmp_path / "f"
    src.write_bytes(b"x")
    with pytest.raises(ObjectStoreError, match="S3UploadFailedError"):  # boto3's managed transfer, wrapped
        missing.put_file("k", src)
    with pytest.raises(ProviderError, match="failed to write .*NoSuchBucket"):  # what the CLI shows
        with aws_errors("write the job record"):
            missing.put_bytes("k", b"x")


def test_aws_errors_judges_a_store_error_by_its_cause() -> None:
    from botocore.exceptions import ClientError, NoCredentialsError

    def wrapped(cause: BaseException) -> ObjectStoreError:
        try:
            raise ObjectStoreError("cannot write s3://b/k") from cause
        except ObjectStoreError as e:
            return e

    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "not yours"}}, "PutObject")
    with pytest.raises(ProviderError, match="denied permission to upload: not yours"):
        with aws_errors("upload"):
            raise wrapped(denied)
    with pytest.raises(NotSetUp, match="no AWS credentials"):
        with aws_errors("upload"):
            raise wrapped(NoCredentialsError())


def test_s3_content_type_is_kept(moto_env: str, s3_url: str) -> None:
    store = S3Store(s3_url)
    store.put_bytes("events/x.jsonl", b"{}\n", "application/x-ndjson")
    head = store.client.head_object(Bucket=store.bucket, Key=f"{store.prefix}/events/x.jsonl")
    assert head["ContentType"] == "application/x-ndjson"


def test_opening_a_store_loads_no_boto3_and_file_urls_never_do(tmp_path: Path) -> None:
    code = ("import sys; from petctl.io.objstore import open_object_store; "
            "s = open_object_store('s3://bucket/prefix'); assert 'boto3' not in sys.modules; "
            f"f = open_object_store({str(tmp_path)!r}); f.put_bytes('a/b', b'1'); "
            "assert f.get_bytes('a/b') == b'1'; "
            "assert 'boto3' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_open_parent_names_the_store_and_key(tmp_path: Path) -> None:
    (tmp_path / "agent.json").write_text("{}")
    for url in (str(tmp_path / "agent.json"), (tmp_path / "agent.json").as_uri()):
        store, key = open_parent(url)
        assert isinstance(store, FileStore) and key == "agent.json" and read_url(url) == b"{}"
    store, key = open_parent("s3://bucket/jobs/a/agent.json")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, key) == ("bucket", "jobs/a", "agent.json")
    store, key = open_parent("s3://bucket/top.json")
    assert isinstance(store, S3Store) and (store.prefix, key) == ("", "top.json")
    for bad in ("s3://bucket", "s3://bucket/", "gs://bucket/x", "file://host/x"):
        with pytest.raises(ValueError):
            open_parent(bad)
    with pytest.raises(ObjectNotFound):
        read_url(str(tmp_path / "missing.json"))


def test_the_agent_loads_its_config_and_code_from_s3_and_files(moto_env: str, s3_url: str,
                                                               tmp_path: Path) -> None:
    from petctl.agent.code import fetch_code
    from petctl.agent.main import load_config

    config = AgentConfig(job=JobSpec(name="demo", min_size=1, max_size=2, size=1, entrypoint="train.py"),
                         node_id="i-1")
    store = open_object_store(s3_url)
    store.put_bytes("agent.json", config.to_json().encode())
    assert load_config(f"{s3_url}/agent.json") == config
    local = tmp_path / "agent.json"
    local.write_text(config.to_json())
    assert load_config(str(local)) == load_config(local.as_uri()) == config
    with pytest.raises(OSError):  # what main() turns into a one-line error
        load_config(f"{s3_url}/missing.json")

    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        data = b"print('hi')\n"
        member = tarfile.TarInfo("pkg/train.py")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    store.put_bytes("code/code.tar.gz", archive.getvalue())
    store.put_bytes("code/single.py", b"print(1)\n")
    dest = fetch_code(f"{s3_url}/code/code.tar.gz", tmp_path / "code")
    assert (dest / "pkg" / "train.py").read_bytes() == data
    assert not list(tmp_path.glob(".code.*"))  # the downloaded archive is gone
    dest = fetch_code(f"{s3_url}/code/single.py", tmp_path / "code")
    assert [p.name for p in dest.iterdir()] == ["single.py"]  # replaced, not merged


def test_layers_the_agent_and_the_cli_never_load_the_library_or_torch() -> None:
    """The agent reaches the store through petctl.io, never through petctl.elastic (which would bring
    torch); petctl.io imports nothing of petctl but petctl.core."""
    code = ("import sys; import petctl.agent.main, petctl.agent.reporting, petctl.agent.code, "
            "petctl.agent.workers, petctl.agent.warm_worker, petctl.jobview.prefix, "
            "petctl.providers.aws.storage, "
            "petctl.io.objstore, petctl.io.files, petctl.io.procs, "
            "petctl.io.etcd, petctl.io.aws; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'boto3', 'botocore') "
            "or m.startswith('petctl.elastic')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    for path in (REPO / "petctl" / "io").glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and words[1].startswith("petctl."):
                assert words[1].startswith(("petctl.core", "petctl.io")), f"{path.name}: {line}"
    for path in (REPO / "petctl" / "elastic").glob("*.py"):
        assert "petctl.agent" not in path.read_text(), path.name
