"""Issue 47: the fleet bench on the agent's own rendezvous code (bench/fleetreal.py): eight real
`EtcdRendezvous` nodes in one process rank 0..7 against a real etcd, the clock starts at the first
registration, and a run whose heartbeats ran late is marked invalid rather than quoted."""

from __future__ import annotations

import pytest

from bench import fleetreal
from petctl.core.spec import JobSpec


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_eight_real_nodes_rank_and_the_clock_starts_at_the_first_registration(etcd_server):
    run = fleetreal.run_once(etcd_server.endpoint, 8, "v3", timeout=60.0)
    assert run["ranks_ok"] and not run["errors"], run
    assert run["ranked_s"] == pytest.approx(run["mass_join_s"] + run["ranking_s"], abs=1e-3), run
    assert run["requests_per_node"]["mean"] > 0, run
    # Every node read at least the round record; the closer read `live/` whole, one key per node.
    assert run["keys_read_per_node"]["mean"] >= 1 and run["keys_read_per_node"]["max"] >= 8, run


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nodes_dealt_over_processes_rank_as_one_job_on_one_clock(etcd_server):
    """Three shard processes hold 9 nodes (3 each): one job, ranks 0..8 once each, and the registrations
    of every process on one clock (the mass join is short, not the gap between two interpreters). Then
    they hold the round at rest while the driver counts what etcd sees."""
    run = fleetreal.run_once(etcd_server.endpoint, 9, "v3", timeout=90.0, procs=3, rest_s=3.0, settle_s=0.5)
    assert run["procs"] == 3 and run["ranks_ok"] and not run["errors"], run
    assert 0 <= run["mass_join_s"] < 5.0 and run["ranking_s"] >= 0, run
    assert run["ranked_s"] == pytest.approx(run["mass_join_s"] + run["ranking_s"], abs=1e-3), run
    # The nodes stayed up through the rest window: every one's keep-alives reached etcd (5 a second
    # each), and a steady round made no raft proposal (the bar: at most 1 per node per minute).
    rest = run["rest"]
    assert rest["valid"] and rest["window_s"] >= 3.0, rest
    assert rest["requests_per_node_per_10s"]["v3_lease"] >= 30, rest
    assert rest["proposals_per_node_per_min"] <= 1.0, rest


def nodes(gaps: list[float], ranked: bool = True) -> list[fleetreal.NodeResult]:
    return [fleetreal.NodeResult(f"n{i}", 10.0 + i, 20.0 + i if ranked else None, i, gap, 6)
            for i, gap in enumerate(gaps)]


def test_late_heartbeats_or_unranked_nodes_make_a_run_invalid_and_the_summary_skips_it():
    spec = JobSpec(name="f", min_size=2, max_size=2, size=2, entrypoint="x.py")
    fine = fleetreal._figures(nodes([0.2, 0.3]), 2, "v3", spec, cpu=0.1)
    late = fleetreal._figures(nodes([0.2, 0.6]), 2, "v3", spec, cpu=0.1)  # 2.5 beats of 0.2 s: late
    lost = fleetreal._figures(nodes([0.2, 0.2], ranked=False), 2, "v3", spec, cpu=0.1)
    assert fine["valid"] and (fine["mass_join_s"], fine["ranking_s"], fine["ranked_s"]) == (1.0, 10.0, 11.0)
    assert not late["valid"] and "heartbeats ran late" in late["saturated"]
    assert not lost["valid"] and "not ranked" in lost["saturated"] and "ranked_s" not in lost
    summary = fleetreal.summarize([fine, late, lost])
    assert (summary["valid_runs"], summary["invalid_runs"], summary["ranked_s"]) == (1, 2, 11.0)
    assert summary["etcd_cpu_per_node_s"] is None  # these runs never read etcd's CPU
    for run, etcd_s in ((fine, 0.0125), (late, 9.0), (lost, 9.0)):
        run["etcd_cpu_per_node_s"] = etcd_s
    summary = fleetreal.summarize([fine, late, lost])
    assert summary["etcd_cpu_per_node_s"] == 0.0125, summary  # the valid run's alone
    row = fleetreal.table({"v3/N=2": {"nodes": 2, "store": "v3", "runs": [fine], "summary": summary}})
    assert "| 0.0125 s |" in row, row
    assert "invalid" in fleetreal.table({"v3/N=2": {"nodes": 2, "store": "v3", "runs": [late],
                                                    "summary": fleetreal.summarize([late])}})


def test_the_rest_window_is_summarized_over_valid_windows_only_and_shown_in_the_table():
    spec = JobSpec(name="f", min_size=2, max_size=2, size=2, entrypoint="x.py")
    runs = []
    for proposals, valid in ((0.0, True), (0.5, True), (9.0, False)):
        run = fleetreal._figures(nodes([0.2, 0.3]), 2, "v3", spec, cpu=0.1)
        run["rest"] = {"valid": valid, "proposals_per_node_per_10s": proposals,
                       "requests_total_per_node_per_10s": 50.0 + proposals,
                       "etcd_cpu_per_node_per_10s": 0.002 + proposals / 100}
        runs.append(run)
    summary = fleetreal.summarize(runs)
    assert summary["rest_windows"] == 2, summary
    assert summary["rest_proposals_per_node_per_10s"] == 0.25, summary
    assert summary["rest_requests_per_node_per_10s"] == 50.25, summary
    assert summary["rest_etcd_cpu_per_node_per_10s"] == 0.0045, summary  # not cut to 3 digits
    row = fleetreal.table({"v3/N=2": {"nodes": 2, "store": "v3", "runs": runs, "summary": summary}})
    assert "| 0.25 | 50.25 | 0.0045 |" in row, row
    assert summary["keys_read_per_node"] == 0.0, summary  # the hand-made nodes read nothing
    bare = fleetreal._figures(nodes([0.2, 0.3]), 2, "v3", spec, cpu=0.1)  # no window asked for
    row = fleetreal.table({"v3/N=2": {"nodes": 2, "store": "v3", "runs": [bare],
                                      "summary": fleetreal.summarize([bare])}})
    assert "| - | - | - |" in row, row


def test_etcds_counters_are_read_from_one_metrics_answer_and_a_missing_one_is_an_error():
    from bench import rest

    text = ("# HELP process_cpu_seconds_total x\nprocess_cpu_seconds_total 12.34\n"
            "etcd_server_proposals_committed_total 7\nprocess_cpu_seconds_total_other 99\n")
    assert rest._value(text, "process_cpu_seconds_total") == 12.34
    assert rest._value(text, "etcd_server_proposals_committed_total") == 7
    with pytest.raises(ValueError, match="etcd_server_leader_changes_seen_total"):
        rest._value(text, "etcd_server_leader_changes_seen_total")


def test_the_rest_table_shows_etcds_cpu_above_its_own_idle_and_the_idle_itself():
    from bench import rest

    run = {"nodes": 4, "store": "v3", "window_s": 60.0, "proposals_per_node_per_10s": 0.0,
           "proposals_per_node_per_min": 0.0, "requests_total_per_node_per_10s": 150.0,
           "requests_per_node_per_10s": {"v3_lease": 142.0, "v3_kv": 8.0}, "etcd_cpu_per_node_per_10s": 0.05,
           "etcd_cpu_above_idle_per_node_per_10s": 0.02, "agent_cpu_per_node_per_10s": 0.2}
    text = rest.table([run], etcd_idle_per_10s=0.12)
    assert "| 0.05 (0.02) |" in text and "etcd with no client: 0.12 CPU s per 10 s." in text, text
    assert "no client" not in rest.table([run]), "no idle read: no idle line"


def test_a_loop_that_ran_late_makes_a_run_invalid_whatever_the_heartbeats_say():
    """With an AWS job's keep-alive every 2 s, a ranking of a second may see no keep-alive at all; the
    shared loop's lag still shows a saturated process."""
    spec = fleetreal.job_spec("http://127.0.0.1:1", "f", 2, "v3", "aws")
    assert spec.timeouts.heartbeat_interval == 2.0 and fleetreal.late_gap(spec) == pytest.approx(2.3)
    local = fleetreal.job_spec("http://127.0.0.1:1", "f", 2, "v3")
    assert fleetreal.late_gap(local) == pytest.approx(0.5)  # 2.5 beats of 0.2 s, as before
    with pytest.raises(ValueError, match="unknown timeouts 'lan'"):
        fleetreal.job_spec("http://127.0.0.1:1", "f", 2, "v3", "lan")
    fine = fleetreal._figures(nodes([0.0, 0.0]), 2, "v3", spec, cpu=0.1, loop_lag=0.1)
    late = fleetreal._figures(nodes([0.0, 0.0]), 2, "v3", spec, cpu=0.1, loop_lag=0.35)
    assert fine["valid"] and fine["longest_loop_lag_s"] == 0.1, fine
    assert not late["valid"] and "the event loop ran late: by 0.35 s" in late["saturated"], late


def test_the_loop_lag_probe_sees_a_blocked_loop():
    import time

    from petctl.io.store.v3 import LoopThread

    loop = LoopThread("lagtest")
    lag = fleetreal.LoopLag(loop.loop)
    try:
        lag.start()
        time.sleep(0.2)
        loop.loop.call_soon_threadsafe(time.sleep, 0.5)  # the loop's thread held for half a second
        time.sleep(0.8)
        assert lag.worst >= 0.4, lag.worst
    finally:
        lag.stop()
        loop.close()
    idle = fleetreal.LoopLag(None)  # v2: no shared loop, nothing to time
    idle.start()
    assert idle.worst == 0.0
