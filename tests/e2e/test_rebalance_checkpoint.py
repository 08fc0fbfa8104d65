"""A checkpoint request on one node, across two real gloo ranks (each its own node): both ranks agree on
the step in the save-now check's all-reduce, the writer saves it at once, training goes on to the end,
and a request is answered once (the one-writer `Checkpointer`; the sharded one saves collectively)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers_gloo import WORKER_PRELUDE, run_worker_pair
from tests.support.ledger import manifests

pytestmark = pytest.mark.slow  # two torch processes each: ~15 s on 2 cores

ASK_AT, STEPS = 6, 20

WORKER = WORKER_PRELUDE + r'''
from petctl.elastic import Checkpointer, State
from petctl.elastic import ShardedCheckpointer, ShardedState

net = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
sharded = os.environ["KIND"] == "sharded"
state = ({"app": ShardedState(net, opt, extra={"step": -1})} if sharded
         else State(model=net, optimizer=opt, extra={"step": -1}))
ckpt = (ShardedCheckpointer(keep=10, every=0) if sharded else Checkpointer(keep=10, every=0))
stepped = []
for step in range(int(os.environ["STEPS"])):
    if rank == 1 and step == int(os.environ["ASK_AT"]):  # this node's agent asks (the other's does not)
        controlfiles.request_checkpoint(os.environ["PETCTL_CONTROL_DIR"], "rebalance")
    if ckpt.step_end(step, state):
        break
    stepped.append(step)
ckpt.close()
out.write_text(json.dumps({"stepped": stepped}))
dist.destroy_process_group()
'''


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["one-writer", "sharded"])
def test_a_request_on_one_node_saves_the_same_step_everywhere_and_training_goes_on(tmp_path: Path,
                                                                                   kind: str) -> None:
    store = tmp_path / "ckpt"
    r0, r1 = run_worker_pair(tmp_path, WORKER, "train", store.as_uri(), tag="train", timeout=180,
                             rank_env=lambda rank: {"PETCTL_CACHE_DIR": str(tmp_path / f"cache-{rank}"),
                                                    "KIND": kind, "STEPS": str(STEPS), "ASK_AT": str(ASK_AT)})
    assert r0["stepped"] == r1["stepped"] == list(range(STEPS))  # nobody left the loop
    assert manifests(store) == [ASK_AT]  # the requested step, saved once (no periodic saves here)
    answer = json.loads((tmp_path / "control-1" / "checkpointed.0").read_text())
    assert answer == {"seq": 1, "step": ASK_AT}
    assert not (tmp_path / "control-0" / "checkpointed.0").exists()  # rank 0's node had no request
