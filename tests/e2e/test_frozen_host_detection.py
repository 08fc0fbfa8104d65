"""A frozen host is dropped by the member watching it, not by etcd's TTL.

Three real agents and gloo workers against a real etcd; one node's process group is SIGSTOPped (its
sockets stay open, its heartbeat simply stops). What is timed is the issue's detection: the freeze ->
the moment every survivor knows (its own `membership.lost`, or the next round it joined because another
survivor declared the loss). The member watching the frozen one (agent/liveness.py) drops it.

The watch runs with the default refresh interval and silence limit (1 s), but etcd's TTL is 10 s, not 3.
With the default TTL both mechanisms are armed, and on a starved 2-core box the watcher rightly holds back
while its own refreshes lag (`observe`: it might be the frozen one), so the TTL can win that race: a test
of "the watch drops it" would then be a coin toss. The time itself (issue 16's
goal: 1.5 s, default TTL) is measured by bench P2, beside the TTL-only detection, not asserted here; what
this test pins is the mechanism (the watch drops exactly the frozen node, and every survivor learns of it).
"""

from __future__ import annotations

import itertools
import signal
import time

import pytest

from petctl.core.spec import Timeouts
from tests.support.agent_harness import AgentCluster, make_spec, wait_for

pytestmark = pytest.mark.slow
_names = itertools.count()
KNOWN = ("membership.lost", "rendezvous.restart", "rendezvous.joined")  # a survivor has learnt of the loss


# A watch 9 s late is not load, it is a bug; the TTL still bounds what waits on it (a worker failure's
# grace is TTL + a refresh: the survivors' re-form at 2 must come inside the test's 30 s).
TTL = 10.0


def defaults() -> dict[str, float]:
    """The watch's timing every job gets by default, with a TTL that cannot win the race (see above)."""
    t = Timeouts()
    return {"heartbeat_interval": t.heartbeat_interval, "heartbeat_ttl": TTL, "peer_silence": t.peer_silence}


def knew_at(agent, after: float) -> float | None:
    hits = [e["ts"] for e in agent.events() if e["event"] in KNOWN and e["ts"] > after]
    return min(hits) if hits else None


@pytest.mark.parametrize("frozen_rank", [2, 0])
def test_the_member_watching_a_frozen_host_drops_it_and_every_survivor_knows(etcd_server, tmp_path,
                                                                           frozen_rank):
    spec = make_spec(f"detect{next(_names)}", etcd_server.endpoint, min_size=2, max_size=3, size=3,
                     env={"STEP_TIME": "0.05"}, **defaults())
    cluster = AgentCluster(etcd_server.endpoint, tmp_path / spec.name, spec)
    try:
        nodes = [cluster.start() for _ in range(3)]
        st = wait_for(lambda: (s := cluster.state()).state == "running" and s.world_size == 3 and s, 60,
                      what="world of 3")
        wait_for(lambda: all(cluster.steps(n.node_id) for n in nodes), 60, what="every node training")
        time.sleep(1.0)  # a few seconds of steady state: refreshes and the peer watch running
        frozen = next(n for n in nodes if st.ranks[n.node_id] == frozen_rank)
        survivors = [n for n in nodes if n is not frozen]
        t_freeze = time.time()
        frozen.signal_group(signal.SIGSTOP)
        wait_for(lambda: all(knew_at(n, t_freeze) for n in survivors), 15, interval=0.05,
                 what="every survivor knows")
        known = max(knew_at(n, t_freeze) for n in survivors) - t_freeze
        print(f"frozen rank {frozen_rank}: every survivor knew after {known:.3f} s")  # shown with -rP
        watcher = next((n for n in survivors if n.events("peer.silent")), None)
        assert watcher is not None, f"no survivor's watch dropped the frozen node (known after {known:.3f} s)"
        assert [e["nodes"] for e in watcher.events("peer.silent")] == [[frozen.node_id]]
        lost = [e for n in survivors for e in n.events("membership.lost") if e["ts"] > t_freeze]
        assert lost and all(e["nodes"] == [frozen.node_id] for e in lost)
        st2 = wait_for(lambda: (s := cluster.state()).state == "running" and s.world_size == 2 and s, 30,
                       what="re-formed at 2")
        assert set(st2.ranks) == {n.node_id for n in survivors} and st2.round.restarts == 0
    finally:
        cluster.stop_all()
