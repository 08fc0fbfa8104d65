"""Issue 47, "nothing at rest": three real agents holding a steady round cost etcd at most one raft
proposal per node per minute, counted by etcd itself (`etcd_server_proposals_committed_total`) over
60 s, after the round has settled (the status backoff's first puts: petctl/agent/reporting.py).

It runs bench/rest.py's measurement, so the bench's figure and this bound are one code path. Before the
change the agent put its status every 5 s: 12 proposals per node per minute.
"""

from __future__ import annotations

import pytest

from bench.rest import measure

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_three_nodes_at_rest_make_at_most_one_proposal_per_node_per_minute(etcd_server, tmp_path):
    result = measure(tmp_path, etcd_server.endpoint, nodes=3, store="v3", settle=90.0, window=60.0)
    assert result["proposals_per_node_per_min"] <= 1.0, result
    # The window saw a live job: its heartbeats (lease keep-alives, no proposal) reached etcd.
    assert result["requests"]["v3_lease"] > 0, result
    # ... and cost etcd CPU: about 2700 requests in the window, each far above the counter's 0.01 s tick
    # over all of them, and far below the window.
    assert 0 < result["etcd_cpu_s"] < result["window_s"], result


@pytest.mark.timeout(120)
def test_a_whole_read_costs_etcd_cpu_per_key_and_leaves_no_key_behind(etcd_server):
    from bench.rest import idle_cpu, whole_read_cost
    from petctl.io.store import open_store

    idle = idle_cpu(etcd_server.endpoint, 3.0)
    cost = whole_read_cost(etcd_server.endpoint, keys=500, seconds=3.0, idle_per_10s=idle)
    assert cost["keys"] == 500 and cost["reads"] >= 20, cost  # 20 reads a second, each of every key
    # 500 keys read 20 times a second cost etcd well above its idle: a positive cost per key
    assert cost["etcd_us_per_key"] > 0 and cost["etcd_ms_per_read"] > 0, cost
    kv = open_store(etcd_server.endpoint, "v3", None, 5.0)
    try:
        assert not kv.list("/petctl-bench/whole-read").entries, "the scratch keys were left behind"
    finally:
        kv.close()
