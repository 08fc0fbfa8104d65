"""The etcd host's etcd: the etcd project's linux-amd64 tarball, pinned by version and SHA-256 (issue 24.5).

`setup` downloads the tarball on the operator's machine and ships etcd and etcdctl only when the
tarball's SHA-256 is the one pinned in petctl/providers/aws/etcdbin.py (RELEASES). These tests serve
tarballs from a loopback server laid out like etcd's GitHub releases (tests/aws/conftest.py etcd_mirror):
a wrong checksum is refused in one line with nothing uploaded or created, the right one is shipped, a
verified tarball is not downloaded twice.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from petctl.core.errors import ValidationError
from petctl.core.store import BACKENDS
from petctl.providers.aws import etcdbin
from petctl.providers.aws.etcdbin import EtcdRelease, fetch_release
from tests.support.aws.account import REGION, boto
from tests.support.aws.etcd_release import fake_etcd_tarball

ROOT = Path(__file__).resolve().parents[2]


def test_one_table_pins_a_current_release_per_store():
    assert set(etcdbin.RELEASES) == set(BACKENDS) == {"v3", "v2"}
    for release in etcdbin.RELEASES.values():
        assert re.fullmatch(r"v3\.\d+\.\d+", release.version)
        assert re.fullmatch(r"[0-9a-f]{64}", release.sha256)
        assert release.tarball == f"etcd-{release.version}-linux-amd64.tar.gz"
    v3, v2 = (tuple(int(n) for n in etcdbin.RELEASES[s].version[1:].split(".")) for s in ("v3", "v2"))
    # store=v3 (the default): a current 3.6 release, and at least 3.6.11, the oldest 3.6 the 3.7 upgrade
    # guide lets roll to 3.7 (https://etcd.io/docs/v3.7/upgrades/upgrade_3_7/).
    assert v3[:2] == (3, 6) and v3 >= (3, 6, 11)
    # store=v2: 3.5 until etcd 3.5's end of support (the v2 API is gone from 3.6). At least 3.5.10: the
    # HTTP/2 rapid-reset fix (CVE-2023-44487), and past the 3.5.3/3.5.4 crash-consistency fixes.
    assert v2[:2] == (3, 5) and v2 >= (3, 5, 10)
    assert etcdbin.DOWNLOAD_URL == "https://github.com/etcd-io/etcd/releases/download"


def test_the_pins_are_the_published_checksums():
    """The SHA-256s as the releases' SHA256SUMS list them (copied in kubernetes-sigs/kubespray's
    checksums.yml, cited next to RELEASES): a bump that changes a version must change its hash too."""
    assert etcdbin.RELEASES["v3"] == EtcdRelease(
        "v3.6.14", "ffe840ff9295808e88cce2794a18a5ac87f12a5203c8314d0bf6aa119b41bac5")
    assert etcdbin.RELEASES["v2"] == EtcdRelease(
        "v3.5.33", "5025b5b24d81a9616b6e284ccd439b9a3df055ef8fdcdc142af3ec8f6a3b3c95")


def test_a_wrong_checksum_is_refused_in_one_line_and_nothing_is_kept(etcd_mirror, tmp_path):
    cache = tmp_path / "cache"
    wrong = EtcdRelease(etcd_mirror.release.version, "0" * 64)
    with pytest.raises(ValidationError) as refused:
        fetch_release(wrong, etcd_mirror.url, cache)
    message = str(refused.value)
    assert "\n" not in message and "refusing to ship it" in message
    assert etcd_mirror.release.sha256 in message and "0" * 64 in message  # what it got, what is pinned
    assert sorted(p.name for p in cache.iterdir()) == []  # no tarball, no partial file, nothing extracted
    assert len(etcd_mirror.requests) == 1


def test_the_pinned_tarball_is_extracted_verified_and_cached(etcd_mirror, tmp_path):
    cache = tmp_path / "cache"
    artifact = fetch_release(etcd_mirror.release, etcd_mirror.url + "/", cache)
    assert artifact.version == "v3.6.99"
    assert (artifact.sha256, artifact.ctl_sha256) == (etcd_mirror.etcd_sha256, etcd_mirror.etcdctl_sha256)
    assert hashlib.sha256(artifact.path.read_bytes()).hexdigest() == artifact.sha256
    assert artifact.key == f"dist/etcd/v3.6.99-{artifact.sha256[:16]}/etcd"
    assert etcd_mirror.requests == ["/v3.6.99/etcd-v3.6.99-linux-amd64.tar.gz"]
    again = fetch_release(etcd_mirror.release, etcd_mirror.url, cache)  # from the cache: no download
    assert again == artifact and len(etcd_mirror.requests) == 1
    (cache / etcd_mirror.release.tarball).write_bytes(b"tampered")  # a cache that no longer verifies
    assert fetch_release(etcd_mirror.release, etcd_mirror.url, cache) == artifact
    assert len(etcd_mirror.requests) == 2  # downloaded again, and verified again


@pytest.mark.parametrize("url", ["http://example.com/etcd", "ftp://127.0.0.1/etcd", "file:///tmp/etcd"])
def test_only_https_or_loopback_http(url, tmp_path):
    with pytest.raises(ValidationError, match="must be https"):
        fetch_release(EtcdRelease("v3.5.99", "0" * 64), url, tmp_path)


def test_a_missing_release_or_a_tarball_without_etcdctl_is_one_line(etcd_mirror, tmp_path):
    with pytest.raises(ValidationError, match=r"cannot download etcd v3\.5\.98 from .*404") as missing:
        fetch_release(EtcdRelease("v3.5.98", "0" * 64), etcd_mirror.url, tmp_path / "a")
    assert "\n" not in str(missing.value)
    build = tmp_path / "partial"
    build.mkdir()
    sha = etcd_mirror.publish(fake_etcd_tarball(build, "v3.5.97", members=("etcd",)), "v3.5.97")
    with pytest.raises(ValidationError, match="has no etcd-v3.5.97-linux-amd64/etcdctl"):
        fetch_release(EtcdRelease("v3.5.97", sha), etcd_mirror.url, tmp_path / "b")


def test_setup_refuses_a_wrong_checksum_before_anything_exists_and_ships_the_right_one(
        provider, moto, stack_name, etcd_mirror, monkeypatch):
    pinned = etcd_mirror.release
    monkeypatch.setitem(etcdbin.RELEASES, "v3", EtcdRelease(pinned.version, "f" * 64))
    with pytest.raises(ValidationError, match="refusing to ship it") as refused:
        provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name)
    assert "\n" not in str(refused.value)
    stacks = boto(moto, "cloudformation").describe_stacks()["Stacks"]
    assert not [s for s in stacks if s["StackName"] == stack_name]  # no stack, so no bucket to upload to
    assert not [b for b in boto(moto, "s3").list_buckets()["Buckets"] if stack_name in b["Name"]]
    secrets = boto(moto, "secretsmanager").list_secrets()["SecretList"]
    assert not [s for s in secrets if s["Name"].startswith(f"{stack_name}/")]  # nor etcd's certificates

    monkeypatch.setitem(etcdbin.RELEASES, "v3", pinned)
    provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name)
    bucket = provider.settings["outputs"]["BucketName"]
    s3 = boto(moto, "s3")
    stored = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="dist/etcd/")["Contents"])
    prefix = f"dist/etcd/v3.6.99-{etcd_mirror.etcd_sha256[:16]}/"
    assert [k for k in stored if not k.startswith("dist/etcd/boot-")] == [prefix + "etcd", prefix + "etcdctl"]
    shipped = s3.get_object(Bucket=bucket, Key=prefix + "etcd")["Body"].read()
    assert hashlib.sha256(shipped).hexdigest() == etcd_mirror.etcd_sha256  # the tarball's etcd, as is
    (boot,) = [k for k in stored if k.startswith("dist/etcd/boot-")]
    script = s3.get_object(Bucket=bucket, Key=boot)["Body"].read().decode()
    assert f"ETCD_SHA256={etcd_mirror.etcd_sha256}" in script
    assert f"CTL_SHA256={etcd_mirror.etcdctl_sha256}" in script
    assert "ETCD_VERSION=v3.6.99" in script and "--enable-v2" not in script  # store=v3, the default
    assert provider.settings["store"] == "v3"
    provider.setup()  # again: neither downloaded nor uploaded twice
    assert len(etcd_mirror.requests) == 2  # the refused download, then the one verified tarball
    assert sum(1 for line in provider.lines if line.startswith("uploaded etcd")) == 1


def test_the_cli_refuses_a_forged_tarball_of_the_pinned_release(moto, aws_env, etcd_mirror, stack_name,
                                                                 tmp_path):
    """The real pin (no monkeypatching: a subprocess) against a tarball that a mirror serves under the
    pinned release's name: one line on stderr, exit 1, no traceback, no stack."""
    real = subprocess.run([sys.executable, "-c", "from petctl.providers.aws.etcdbin import RELEASES as R; "
                           "print(R['v3'].version, R['v3'].sha256)"], capture_output=True, text=True,
                          check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    version, sha = real
    build = tmp_path / "forged"
    build.mkdir()
    assert etcd_mirror.publish(fake_etcd_tarball(build, version), version) != sha
    out = subprocess.run([sys.executable, "-m", "petctl", "setup", "--provider", "aws", "--region", REGION,
                          "--endpoint-url", moto, "--option", f"stack_name={stack_name}",
                          "--option", f"etcd_download_url={etcd_mirror.url}"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode != 0 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert f"not the pinned {sha} of etcd {version}: refusing to ship it" in line
    assert etcd_mirror.requests == [f"/{version}/etcd-{version}-linux-amd64.tar.gz"]
    stacks = boto(moto, "cloudformation").describe_stacks()["Stacks"]
    assert not [s for s in stacks if s["StackName"] == stack_name]
