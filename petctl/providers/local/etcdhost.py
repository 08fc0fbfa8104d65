"""The local provider's shared infrastructure: one embedded etcd, started detached so it outlives the
`petctl setup` that started it, found again later by its recorded pid and start time."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from petctl.providers.local.procs import ProcRef, start_ticks, wait_gone


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

    return etcd_healthy(endpoint, timeout=1.0)


def start(root: Path) -> dict[str, Any]:
    """Start a detached etcd with its data under `root/etcd`; returns the settings that find it again."""
    from petctl.io.etcd import EtcdServer

    etcd_dir = root / "etcd"
    etcd_dir.mkdir(parents=True, exist_ok=True)
    server = EtcdServer.start(etcd_dir, log_path=etcd_dir / "etcd.log", detach=True)
    return {"etcd_endpoint": server.endpoint, "etcd_pid": server.pid, "etcd_start": start_ticks(server.pid)}


def stop(settings: dict[str, Any]) -> None:
    """SIGTERM the recorded etcd, SIGKILL it if it lingers; a no-op when it is gone (or not ours)."""
    ref = recorded(settings)
    if ref is not None and ref.alive():
        ref.signal(signal.SIGTERM)
        if not wait_gone([ref], 5.0):
            ref.signal(signal.SIGKILL)
            wait_gone([ref], 5.0)
