"""What every scenario gets: where to write, the shared servers, and the run's size knobs."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Context:
    root: Path  # scratch directory of this benchmark run (logs of every node are kept there)
    reps: int
    quick: bool
    etcd: Any  # petctl.io.etcd.EtcdServer
    imds: Any  # petctl.providers.local.metadata_server.LocalMetadataServer (started)
    systems: list[str] = field(default_factory=lambda: ["petctl", "torchrun-c10d", "torchrun-etcd-v2"])
    hang_cap: float = 30.0  # P2: how long torchrun is given before "> cap" is reported
    grace: float = 20.0  # P1: seconds between the notice and the SIGKILL
    sizes: list[int] = field(default_factory=lambda: [8, 32, 64])  # P5 node counts
    timeline: dict[str, Any] = field(default_factory=dict)  # P1/P2 runs kept for the chart
    workloads: list[str] = field(default_factory=lambda: ["bench"])  # P1-P3: "bench" and/or "user"

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def dir(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path
