"""Agents given every member of a real 3-member etcd cluster: losing the member their clients use (SIGKILL,
as a lost instance) must not stop or restart the job (`setup --etcd-nodes 3` on AWS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.agent_harness import AgentCluster, dump, make_spec, wait_for
from tests.support.etcd_cluster import running

pytestmark = pytest.mark.slow
STEPS = 80


@pytest.fixture
def etcd3(tmp_path: Path):
    with running(tmp_path / "etcd") as c:
        yield c


def test_losing_the_etcd_member_in_use_restarts_nothing(etcd3, tmp_path):
    spec = make_spec("etcd3", etcd3.endpoints, min_size=2, max_size=2,
                     env={"STEPS": str(STEPS), "STEP_TIME": "0.1"})
    agents = AgentCluster(etcd3.endpoints, tmp_path / "job", spec)
    try:
        a, b = agents.start(), agents.start()
        wait_for(lambda: len(agents.steps(a.node_id)) >= 15 or a.proc.poll() is not None, 90,
                 what="training under way")
        assert a.proc.poll() is None, dump(a.events()[-5:])  # (fail fast: an agent that died at start)
        # Every client starts on the first endpoint: that is the member they use.
        etcd3.kill(etcd3.members[0])
        assert a.proc.wait(timeout=120) == 0 and b.proc.wait(timeout=120) == 0, dump(a.events()[-20:])
        final = agents.state()
        assert final.result.state == "succeeded", dump(final.to_dict())
        assert final.round.restarts == 0
        for agent in (a, b):
            steps = agent.events("train.step")
            assert [s["step"] for s in steps] == list(range(STEPS))  # no step redone, none lost
            assert {s["world_size"] for s in steps} == {2} and {s["restart"] for s in steps} == {"0"}
            assert agent.events("rendezvous.restart") == []
            assert len(agent.events("rendezvous.complete")) == 1  # one round, start to finish
    finally:
        agents.stop_all()
