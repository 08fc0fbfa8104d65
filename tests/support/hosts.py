"""A provider's view of one instance (`HostInfo`) in one line, for the decision tests over host lists."""

from __future__ import annotations

from petctl.providers.base import HostInfo


def host(iid: str, state: str = "running", launched: float = 0.0) -> HostInfo:
    return HostInfo(host_id=iid, state=state, instance_type="local", market="local", private_ip="127.0.0.1",
                    launched_at=launched)
