"""The local provider's shared infrastructure: one embedded etcd, started detached so it outlives the
`petctl setup` that started it, found again later by its recorded pid and start time.

It runs as on AWS: https only, a client certificate required from every client, auth on (root for the
provider and the CLI, one user per job run confined to the job's prefix; petctl/io/etcdauth.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from petctl.io.etcdpki import EtcdTls
from petctl.io.procs import ProcRef, start_ticks, wait_gone


def recorded(settings: dict[str, Any]) -> ProcRef | None:
    """The etcd process `setup` recorded, if any."""
    pid = settings.get("etcd_pid")
    return ProcRef(int(pid), settings.get("etcd_start")) if pid else None


def healthy(settings: dict[str, Any]) -> bool:
    """Whether the recorded etcd is our process, alive, and answering at its endpoint."""
    endpoint = settings.get("etcd_endpoint")
    ref = recorded(settings)
    if not endpoint or ref is None or not ref.alive():
        return False
    from petctl.io.etcd import etcd_healthy

    return etcd_healthy(endpoint, timeout=1.0, tls=admin_tls(settings))


def secure_dir(settings: dict[str, Any]):
    """The etcd's certificates (`SecureEtcdDir`), or None for an etcd an older petctl started without."""
    from petctl.io.etcdauth import SecureEtcdDir

    path = settings.get("etcd_pki")
    return SecureEtcdDir(Path(path)) if path else None


def admin_tls(settings: dict[str, Any]) -> EtcdTls | None:
    """root's client credentials (the provider's and the CLI's), None for an etcd without them."""
    secure = secure_dir(settings)
    return secure.root if secure is not None else None


def start(root: Path) -> dict[str, Any]:
    """Start a detached etcd with its data under `root/etcd`, client certificates required and auth on
    (its certificates made at the first start, kept for later ones: the data's users outlive a restart);
    returns the settings that find it again. Raises ProviderError or etcdauth.AuthError."""
    from petctl.io.etcdauth import SecureEtcdDir, start_secure

    etcd_dir = root / "etcd"
    etcd_dir.mkdir(parents=True, exist_ok=True)
    pki = etcd_dir / "pki"
    secure = SecureEtcdDir(pki) if (pki / "pki.json").exists() else SecureEtcdDir.create(pki, "petctl-local")
    server = start_secure(secure, etcd_dir, log_path=etcd_dir / "etcd.log", detach=True)
    return {"etcd_endpoint": server.endpoint, "etcd_pid": server.pid, "etcd_start": start_ticks(server.pid),
            "etcd_pki": str(pki)}


def stop(settings: dict[str, Any]) -> None:
    """SIGTERM the recorded etcd, SIGKILL it if it lingers; a no-op when it is gone (or not ours)."""
    ref = recorded(settings)
    if ref is not None and ref.alive():
        ref.signal(signal.SIGTERM)
        if not wait_gone([ref], 5.0):
            ref.signal(signal.SIGKILL)
            wait_gone([ref], 5.0)
