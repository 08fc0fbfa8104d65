"""The installation's etcd PKI: who may connect to etcd and as whom (the `cryptography` package), and a
client's credentials: its TLS files on disk, and where a job's agents get theirs.

etcd runs with `--client-cert-auth`: every client presents a certificate, and etcd's auth (v2 and v3)
takes its common name (CN) as the client's user. No password crosses the wire, and no request costs a
bcrypt comparison: etcd 3.5's v2 auth checks a basic-auth password with bcrypt (cost 10, fixed) on every
request, about 60 ms of etcd CPU each, against under 1 ms with a client certificate (docs/aws.md,
"Rendezvous (etcd) isolation", has the measurement).

Two certificate authorities, so that a store that is being bootstrapped can admit its administrator only
(etcd trusts the admin CA alone until auth is enabled, then both):
- the admin CA signs etcd's server certificate and root's client certificate (CN `root`);
- the jobs CA signs each job's client certificate (CN = the job's etcd user, unique per run).
Whoever holds a CA's key can mint any identity it signs: both keys stay with the operator (the local
state directory; on AWS a Secrets Manager secret no instance may read).

Python's ssl and urllib3 want files, so a client's credentials (`EtcdTls`) are three PEM files in a
private directory: `ca.pem` (the CA bundle that verifies etcd's server certificate), `cert.pem` and
`key.pem` (this client's). A job names its agents' credentials in `JobSpec.etcd_credentials`, a reference
that is not itself a secret:
- "" : none (a plain-http etcd, as the benchmarks and most tests run);
- `file:///dir` : that directory (the local provider writes one per job);
- `arn:aws:secretsmanager:...` : a Secrets Manager secret holding the three PEMs as JSON
  (`{"ca": ..., "cert": ..., "key": ...}`), readable by that job's instance role only; the agent writes
  them to a private directory of its own.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from petctl.io.files import atomic_write

ROOT_USER = "root"  # etcd's built-in administrator, in v2 and v3 auth alike
CA_DAYS = 3650
LEAF_DAYS = 3650  # revocation is by deleting the etcd user (unique per job run), not by expiry


@dataclass(frozen=True)
class Pem:
    """One certificate and its private key, PEM-encoded."""

    cert: str
    key: str


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer, public_key, days: int):
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def new_ca(name: str) -> Pem:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    key = _new_key()
    cert = (_builder(name, _name(name), key.public_key(), CA_DAYS)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Pem(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))


def issue(ca: Pem, cn: str, server_ips: tuple[str, ...] = ()) -> Pem:
    """A leaf certificate for `cn` signed by `ca`: a client certificate, or with `server_ips` etcd's
    server certificate (those addresses in its SAN; also usable as a client, which etcd's own gRPC
    gateway needs under --client-cert-auth). Raises ValueError for an address that does not parse."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_cert = x509.load_pem_x509_certificate(ca.cert.encode())
    ca_key = serialization.load_pem_private_key(ca.key.encode(), password=None)
    key = _new_key()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = _builder(cn, ca_cert.subject, key.public_key(), LEAF_DAYS)
    if server_ips:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]), critical=False)
    cert = (builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Pem(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))


@dataclass(frozen=True)
class EtcdPki:
    """The operator's half: both CAs (with their keys) and root's client certificate."""

    admin_ca: Pem
    jobs_ca: Pem
    root: Pem

    @classmethod
    def new(cls, name: str) -> EtcdPki:
        admin = new_ca(f"{name} etcd admin CA")
        return cls(admin_ca=admin, jobs_ca=new_ca(f"{name} etcd jobs CA"), root=issue(admin, ROOT_USER))

    def server(self, ips: tuple[str, ...]) -> Pem:
        """etcd's server certificate for these addresses (and 127.0.0.1, for the host's own checks)."""
        return issue(self.admin_ca, "etcd", tuple(dict.fromkeys((*ips, "127.0.0.1"))))

    def job_client(self, user: str) -> Pem:
        """A job's client certificate: CN = its etcd user, signed by the jobs CA."""
        return issue(self.jobs_ca, user)

    @property
    def trusted_clients(self) -> str:
        """etcd's --trusted-ca-file once auth is on: both CAs."""
        return self.admin_ca.cert + self.jobs_ca.cert

    def to_json(self) -> str:
        return json.dumps({"admin_ca": vars(self.admin_ca), "jobs_ca": vars(self.jobs_ca),
                           "root": vars(self.root)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EtcdPki:
        """Raises ValueError (or KeyError) for a document that is not one."""
        data = json.loads(text)
        return cls(admin_ca=Pem(**data["admin_ca"]), jobs_ca=Pem(**data["jobs_ca"]), root=Pem(**data["root"]))


def common_name(cert_pem: str) -> str:
    """The CN of a PEM certificate (the etcd user it authenticates as)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


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
        atomic_write(path / name, text)  # its temporary is created 0600: the key is never readable by others
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
