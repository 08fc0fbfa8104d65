"""The on-disk layout of the local provider, in one place.

    <home>/local/etcd/               embedded etcd data dir, etcd.log
    <home>/local/etcd/pki/           its certificates: both CAs, etcd's, root's (see petctl/io/etcdauth.py)
    <home>/local/jobs/<job>/
        job.json                     spec, created_at, reconciler handle, final state (once over)
        code/                        the uploaded script (a file or a copied directory)
        etcd/                        the job's etcd client certificate (ca.pem, cert.pem, key.pem; 0600):
                                     its user may read and write only /petctl/jobs/<job>/
        checkpoints/                 spec.checkpoint_url points here
        desired                      desired instance count (the reconciler's input, like an ASG's)
        notices/<iid>.json           preemption notices and rebalance recommendations served by the local
                                     metadata endpoint
        reconciler.log               the reconciler's events
        instances.json               the reconciler's view of its instances (written atomically)
        instances/<iid>/             agent.json, agent.log, work/, and `chaos` (why chaos took it)

Files are the interface between the short-lived CLI and the long-lived reconciler: each has one writer
(`desired` and notices: the CLI, except that the reconciler carries a rebalance recommendation on;
instances.json: the reconciler; job.json: whoever holds the job at the time) and every write is atomic,
so a reader never sees half a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl.io.files import atomic_write


def local_root(home: Path) -> Path:
    return home / "local"


@dataclass(frozen=True)
class JobDir:
    path: Path

    @classmethod
    def of(cls, home: Path, job: str) -> JobDir:
        return cls(local_root(home) / "jobs" / job)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def meta_path(self) -> Path:
        return self.path / "job.json"

    @property
    def code(self) -> Path:
        return self.path / "code"

    @property
    def etcd_credentials(self) -> Path:
        return self.path / "etcd"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def mirror(self) -> Path:
        """Where agents mirror status/events/logs (the job's record once etcd forgets it)."""
        return self.path / "mirror"

    @property
    def desired_path(self) -> Path:
        return self.path / "desired"

    @property
    def notices(self) -> Path:
        return self.path / "notices"

    @property
    def reconciler_log(self) -> Path:
        return self.path / "reconciler.log"

    @property
    def instances_path(self) -> Path:
        return self.path / "instances.json"

    def instance(self, iid: str) -> Path:
        return self.path / "instances" / iid

    def agent_log(self, iid: str) -> Path:
        return self.instance(iid) / "agent.log"

    def chaos_marker(self, iid: str) -> Path:
        return self.instance(iid) / "chaos"

    def exists(self) -> bool:
        return self.meta_path.exists()

    # --- job.json --------------------------------------------------------------------------------
    def read_meta(self) -> dict[str, Any]:
        try:
            return json.loads(self.meta_path.read_text())
        except (OSError, ValueError):
            return {}

    def update_meta(self, **fields: Any) -> dict[str, Any]:
        meta = self.read_meta()
        meta.update(fields)
        atomic_write(self.meta_path, json.dumps(meta, indent=2, sort_keys=True))
        return meta

    # --- desired ---------------------------------------------------------------------------------
    def read_desired(self, default: int = 0) -> int:
        try:
            return int(self.desired_path.read_text().strip())
        except (OSError, ValueError):
            return default

    def write_desired(self, size: int) -> None:
        atomic_write(self.desired_path, f"{int(size)}\n")

    # --- instances.json --------------------------------------------------------------------------
    def read_instances(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.instances_path.read_text())
        except (OSError, ValueError):
            return []
        return data if isinstance(data, list) else []

    def write_instances(self, instances: list[dict[str, Any]]) -> None:
        atomic_write(self.instances_path, json.dumps(instances, indent=2, sort_keys=True))

    # --- notices ---------------------------------------------------------------------------------
    def write_notice(self, iid: str, kind: str, when: float, **extra: Any) -> Path:
        """`extra`: what a rebalance adds (its grace, the replacement, when it was recommended)."""
        path = self.notices / f"{iid}.json"
        atomic_write(path, json.dumps({**extra, "kind": kind, "time": when}))
        return path

    def write_capacity_hold(self, until: float) -> None:
        """No capacity for this job until `until` (unix time): the reconciler launches nothing before it
        (a spot trace's capacity delay or outage, `petctl chaos --trace`)."""
        atomic_write(self.path / "capacity-hold", f"{until}\n")

    def capacity_hold(self) -> float:
        """The unix time launches may resume at (0: no hold; an unreadable file is no hold)."""
        try:
            return float((self.path / "capacity-hold").read_text())
        except (OSError, ValueError):
            return 0.0

    def read_notice(self, iid: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.notices / f"{iid}.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and "time" in data else None
