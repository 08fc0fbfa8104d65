"""An etcd on this machine with client certificates required and auth on: the local provider's, and the
tests'. The same model as on AWS (etcdpki.py, etcdauth.py), so local jobs exercise the real code path:
root administers, each job run's agents connect as a user confined to `/petctl/jobs/<job>/`.

On disk, under one private directory (0700; keys 0600):
    pki.json            both CAs with their keys, and root's certificate (the operator's secret)
    server/             etcd's certificate and key, and trusted.pem (both CAs: root's and the jobs')
    root/               root's client credentials (ca.pem, cert.pem, key.pem)
Each job's credentials are written where the provider keeps the job (`job_credentials`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from petctl.io.etcd import EtcdServer, ServerTls, etcd_client, etcdctl_binary
from petctl.io.etcdtls import EtcdTls, write_credentials


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class SecureEtcdDir:
    """The private directory described in the module docstring."""

    path: Path

    @property
    def server(self) -> ServerTls:
        d = self.path / "server"
        return ServerTls(cert=str(d / "cert.pem"), key=str(d / "key.pem"), trusted_ca=str(d / "trusted.pem"))

    @property
    def root(self) -> EtcdTls:
        return EtcdTls.in_dir(self.path / "root")

    def pki(self):
        """The operator's PKI (both CA keys). Raises OSError or ValueError."""
        from petctl.io.etcdpki import EtcdPki

        return EtcdPki.from_json((self.path / "pki.json").read_text())

    @classmethod
    def create(cls, path: str | Path, name: str = "petctl") -> SecureEtcdDir:
        """A new PKI for an etcd on 127.0.0.1, written to `path` (replacing what was there)."""
        from petctl.io.etcdpki import EtcdPki

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
        pki = EtcdPki.new(name)
        _write_private(path / "pki.json", pki.to_json())
        server = pki.server(("127.0.0.1",))
        write_credentials(path / "server", pki.admin_ca.cert, server.cert, server.key)
        _write_private(path / "server" / "trusted.pem", pki.trusted_clients)
        write_credentials(path / "root", pki.admin_ca.cert, pki.root.cert, pki.root.key)
        return cls(path)

    def reissue_server(self, ips: tuple[str, ...]) -> None:
        """etcd's certificate again, valid for `ips` too (a client that reaches this etcd at another
        address: a network namespace, a forwarder). etcd reads its certificate files at each new TLS
        handshake, so a running etcd presents the new one from the next connection on."""
        pki = self.pki()
        server = pki.server(("127.0.0.1", *ips))
        write_credentials(self.path / "server", pki.admin_ca.cert, server.cert, server.key)

    def job_credentials(self, user: str, dest: str | Path) -> EtcdTls:
        """A client certificate for `user` (a job run's etcd user), written to `dest`. The user itself
        is created in etcd by etcdauth.grant_job."""
        pki = self.pki()
        pem = pki.job_client(user)
        return write_credentials(dest, pki.admin_ca.cert, pem.cert, pem.key)

    def root_client(self, endpoint: str, read_timeout: float = 5.0):
        return etcd_client(endpoint, read_timeout=read_timeout, tls=self.root)


def start_secure(secure: SecureEtcdDir, data_dir: str | Path, log_path: str | Path | None = None,
                 detach: bool = False, ports: tuple[int, int] | None = None) -> EtcdServer:
    """Start etcd with `secure`'s certificates and turn auth on (idempotent: a restart keeps it).
    Nobody else holds a certificate yet when a new PKI's etcd starts, so enabling auth after the start
    leaves no window. Raises ProviderError (etcd did not start) or etcdauth.AuthError."""
    from petctl.io.etcdauth import bootstrap

    server = EtcdServer.start(data_dir, log_path=log_path, detach=detach, ports=ports, tls=secure.server,
                              admin=secure.root)
    try:
        bootstrap(secure.root_client(server.endpoint), etcdctl_binary(), server.endpoint, secure.root)
    except BaseException:
        server.stop()
        raise
    return server
