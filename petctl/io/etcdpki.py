"""The installation's etcd PKI: who may connect to etcd, and as whom (the `cryptography` package).

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
"""

from __future__ import annotations

import datetime
import ipaddress
import json
from dataclasses import dataclass

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
