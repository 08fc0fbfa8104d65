"""A client's etcd credentials: TLS files on disk, and where a job's agents get theirs.

etcd authenticates a client by its certificate (`--client-cert-auth`; the certificate's common name is
its etcd user, see etcdpki.py). Python's ssl and urllib3 want files, so credentials are three PEM files
in a private directory: `ca.pem` (the CA bundle that verifies etcd's server certificate), `cert.pem` and
`key.pem` (this client's). A job names its agents' credentials in `JobSpec.etcd_credentials`, a reference
that is not itself a secret:
- "" : none (a plain-http etcd, as the benchmarks and most tests run);
- `file:///dir` : that directory (the local provider writes one per job);
- `arn:aws:secretsmanager:...` : a Secrets Manager secret holding the three PEMs as JSON
  (`{"ca": ..., "cert": ..., "key": ...}`), readable by that job's instance role only; the agent writes
  them to a private directory of its own.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

FILES = ("ca.pem", "cert.pem", "key.pem")
SECRET_ATTEMPTS = 7  # 1+2+4+8+15+15 s between them: about 45 s before an agent gives up on its secret


class CredentialsError(Exception):
    """A job's etcd credentials cannot be read: the agent cannot reach its rendezvous."""


@dataclass(frozen=True)
class EtcdTls:
    """Paths of a client's TLS files (see the module docstring)."""

    ca: str
    cert: str
    key: str

    @classmethod
    def in_dir(cls, path: str | Path) -> EtcdTls:
        path = Path(path)
        return cls(*(str(path / name) for name in FILES))

    def ssl_context(self) -> ssl.SSLContext:
        """A client context: etcd's certificate verified (name included) against `ca`, ours presented.
        Raises OSError or ssl.SSLError when a file is missing or not PEM."""
        context = ssl.create_default_context(cafile=self.ca)
        context.load_cert_chain(self.cert, self.key)
        return context

    def pool_kwargs(self) -> dict[str, str]:
        """The same for a urllib3 pool (what python-etcd's client is built on)."""
        return {"cert_file": self.cert, "key_file": self.key, "ca_certs": self.ca,
                "cert_reqs": "CERT_REQUIRED"}


def write_credentials(path: str | Path, ca: str, cert: str, key: str) -> EtcdTls:
    """Write the three PEMs into `path` (created 0700, files 0600, each replaced atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    for name, text in zip(FILES, (ca, cert, key), strict=True):
        tmp = path / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path / name)
    return EtcdTls.in_dir(path)


def is_secret(ref: str) -> bool:
    return ref.startswith("arn:") and ":secretsmanager:" in ref


def load_credentials(ref: str, cache_dir: str | Path, region: str = "") -> EtcdTls | None:
    """The credentials `ref` names (see the module docstring); None for "". A secret is fetched once
    (retried for about a minute: an instance role's permissions can lag its launch) and written under
    `cache_dir`. Raises CredentialsError with one line when they cannot be had."""
    if not ref:
        return None
    if ref.startswith("file://"):
        tls = EtcdTls.in_dir(urlparse(ref).path)
        missing = [p for p in (tls.ca, tls.cert, tls.key) if not os.path.exists(p)]
        if missing:
            raise CredentialsError(f"etcd credentials missing: {', '.join(missing)}")
        return tls
    if is_secret(ref):
        doc = _fetch_secret(ref, region)
        return write_credentials(cache_dir, doc["ca"], doc["cert"], doc["key"])
    raise CredentialsError(f"unknown etcd credentials reference {ref!r}: expected file:// or a secret ARN")


def _fetch_secret(arn: str, region: str) -> dict[str, str]:
    from tenacity import Retrying, stop_after_attempt, wait_exponential

    from petctl.io.aws import client

    region = region or arn.split(":")[3]
    secrets = client("secretsmanager", profile="agent", region=region)
    retrying = Retrying(stop=stop_after_attempt(SECRET_ATTEMPTS), wait=wait_exponential(1, max=15),
                        reraise=True)
    try:
        value = retrying(lambda: secrets.get_secret_value(SecretId=arn)["SecretString"])
        doc = json.loads(value)
        if not all(isinstance(doc.get(k), str) for k in ("ca", "cert", "key")):
            raise ValueError("expected ca, cert and key")
        return doc
    except Exception as e:  # noqa: BLE001 - botocore's errors, JSON, a malformed secret: one line each
        raise CredentialsError(f"cannot read the job's etcd credentials from {arn}: {e}") from e
