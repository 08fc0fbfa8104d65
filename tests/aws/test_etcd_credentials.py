"""How a job's etcd certificate reaches its agent on AWS (petctl/io/etcdpki.py `load_credentials`), against
moto's Secrets Manager: the agent config names the secret's ARN only; the agent reads the secret with its
instance role, writes the three PEMs into a private directory, and when it cannot, fails with one line
that names the secret and never echoes its value (that line goes to the agent's log and its events)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from petctl.io import etcdpki
from petctl.io.etcdpki import EtcdPki
from tests.support.aws.account import boto

USER = "job-demo-0123abcd"


@pytest.fixture
def secrets(moto: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto)  # what botocore reads; the agent passes no endpoint
    monkeypatch.setattr(etcdpki, "SECRET_ATTEMPTS", 1)  # a missing secret is not retried for 45 s here
    return boto(moto, "secretsmanager")


@pytest.fixture(scope="module")
def doc() -> dict[str, str]:
    pki = EtcdPki.new("test")
    identity = pki.job_client(USER)
    return {"ca": pki.admin_ca.cert, "cert": identity.cert, "key": identity.key}


def test_the_agent_writes_its_runs_certificate_into_a_private_directory(secrets, doc, tmp_path: Path):
    arn = secrets.create_secret(Name="s/etcd/jobs/demo/run1", SecretString=json.dumps(doc))["ARN"]
    tls = etcdpki.load_credentials(arn, tmp_path / "creds")
    assert tls is not None
    assert [Path(p).read_text() for p in (tls.ca, tls.cert, tls.key)] == [doc["ca"], doc["cert"], doc["key"]]
    assert stat.S_IMODE((tmp_path / "creds").stat().st_mode) == 0o700
    assert {stat.S_IMODE(Path(p).stat().st_mode) for p in (tls.ca, tls.cert, tls.key)} == {0o600}
    assert sorted(p.name for p in (tmp_path / "creds").iterdir()) == list(etcdpki.FILES)  # no temp left


def test_a_secret_that_cannot_be_used_fails_with_one_line_without_its_value(secrets, doc, tmp_path: Path):
    broken = {"ca": doc["ca"], "key": doc["key"]}  # no certificate
    arn = secrets.create_secret(Name="s/etcd/jobs/demo/run2", SecretString=json.dumps(broken))["ARN"]
    missing = arn.replace("run2", "gone")
    not_json = secrets.create_secret(Name="s/etcd/jobs/demo/run3", SecretString=doc["key"])["ARN"]
    key_body = doc["key"].split("-----")[2].strip()[:40]
    for ref in (arn, missing, not_json):
        with pytest.raises(etcdpki.CredentialsError) as caught:
            etcdpki.load_credentials(ref, tmp_path / "creds")
        message = str(caught.value)
        assert message.startswith(f"cannot read the job's etcd credentials from {ref}: ")
        assert "\n" not in message and key_body not in message and "PRIVATE KEY" not in message
    assert not (tmp_path / "creds").exists()  # nothing half-written
