"""The local provider's `agent_command` in the partition tests: each instance runs in a lab namespace.

    python tests/support/netns_agent.py <lab.json> <agent.json>

lab.json (written by the test): {"slots": [{"ns", "ns_if", "addr"}, ...], "etcd_endpoint": ...}. The
instance claims the first free slot (an O_EXCL file `slot-<i>.claim` next to lab.json holding its node
id), gets a copy of its config with the lab's etcd endpoint (a forwarder to the provider's etcd) and
the slot's address as its host address, and execs the real agent inside the slot's namespace with gloo
on the slot's interface. `ip netns exec` execs too, so the reconciler's pid is the agent's.
Exit 3 (and one line on stderr) when every slot is taken.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def claim(lab_dir: Path, node_id: str, slots: int) -> int | None:
    """The first slot no other instance holds, now held by `node_id`; None when all are taken."""
    for i in range(slots):
        try:
            fd = os.open(lab_dir / f"slot-{i}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(node_id)
        return i
    return None


def main(argv: list[str]) -> int:
    lab_file, config_path = Path(argv[0]), Path(argv[1])
    lab = json.loads(lab_file.read_text())
    config = json.loads(config_path.read_text())
    index = claim(lab_file.parent, config["node_id"], len(lab["slots"]))
    if index is None:
        print(f"error: every lab slot in {lab_file.parent} is taken", file=sys.stderr)
        return 3
    slot = lab["slots"][index]
    config["job"]["etcd_endpoint"] = lab["etcd_endpoint"]
    config["host_addr"] = slot["addr"]
    ns_config = config_path.with_name("agent-netns.json")
    ns_config.write_text(json.dumps(config))
    os.environ["GLOO_SOCKET_IFNAME"] = slot["ns_if"]
    os.execvp("ip", ["ip", "netns", "exec", slot["ns"], sys.executable, "-m", "petctl.agent.main",
                     "--config", str(ns_config)])
    return 0  # not reached: exec


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
