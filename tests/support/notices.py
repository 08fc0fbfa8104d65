"""Interruption notices for the local IMDSv2 endpoint, written as the chaos command writes them."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from petctl.providers.local.metadata_server import LocalMetadataServer


def write_notice(server: LocalMetadataServer, iid: str, kind: str, when: float) -> None:
    """What the chaos command does: a spot or ASG notice for instance `iid`, the kill due at `when`."""
    server.notices_dir.mkdir(parents=True, exist_ok=True)
    (server.notices_dir / f"{iid}.json").write_text(json.dumps({"kind": kind, "time": when}))
