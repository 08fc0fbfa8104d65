"""Issue 47: the fleet bench on the agent's own rendezvous code (bench/fleetreal.py): eight real
`EtcdRendezvous` nodes in one process rank 0..7 against a real etcd, the clock starts at the first
registration, and a run whose heartbeats ran late is marked invalid rather than quoted."""

from __future__ import annotations

from pathlib import Path

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
    # The CPU bound is computed from this run's own work, on the cores this process may use.
    assert run["cores"] >= 1 and run["cpu_bound_s"] > 0, run


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


def test_the_cpu_bound_is_the_busiest_resource_work_over_its_capacity():
    # One process holds every node: it has one core, whatever the host has.
    assert fleetreal.cpu_bound_s(100, 1, 2, 0.006, 0.002) == pytest.approx(0.6)
    # Two processes on 2 cores: the host's cores hold the nodes' work and etcd's.
    assert fleetreal.cpu_bound_s(100, 2, 2, 0.006, 0.002) == pytest.approx(0.4)
    # More processes than cores: still only the cores.
    assert fleetreal.cpu_bound_s(100, 12, 2, 0.006, 0.002) == pytest.approx(0.4)
    assert fleetreal.cpu_bound_s(1000, 12, 16, 0.006, 0.002) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        fleetreal.cpu_bound_s(0, 1, 2, 0.006, 0.002)


def committed_sizes() -> list[tuple[str, int, list[dict]]]:
    """Every size of the committed fleet results, with the file it came from and its valid runs."""
    import json
    from pathlib import Path

    out = []
    for path in sorted((Path(fleetreal.__file__).parent / "results").glob("fleetreal*.json")):
        data = json.loads(path.read_text())
        for res in data["results"].values():
            runs = [{**run, "procs": run.get("procs", res.get("procs", 1)),
                     "cores": run.get("cores", data["machine"]["cpu_count"])}
                    for run in res["runs"] if run["valid"]]
            out.append((path.name, res["nodes"], runs))
    return out


def test_every_committed_size_ranked_within_30_percent_of_its_cpu_bound():
    """Issue 47's check of the model against the real code at every size both ran. Each valid run whose
    etcd CPU was measured (the bound needs both resources' work) is divided by the bound its own CPU
    gives; a size's figure is the median of its runs' ratios, as every figure is a median of runs. It
    must lie within 30 % of 1: a ranking that waited on a poll, a timeout or a lost wake fails it. Sizes
    run before etcd's CPU was read are not judged: their bound is unknown."""
    import statistics

    judged = []
    for name, nodes, runs in committed_sizes():
        ratios = [run["ranked_s"] / fleetreal.cpu_bound_s(run["nodes"], run["procs"], run["cores"],
                                                           run["cpu_per_node_s"], run["etcd_cpu_per_node_s"])
                  for run in runs if run.get("etcd_cpu_per_node_s") is not None]
        if ratios:
            judged.append((name, nodes, statistics.median(ratios)))
    assert judged, "no committed run to judge"
    off = [j for j in judged if not 0.7 <= j[2] <= 1.3]
    assert not off, f"median ranked_s / cpu_bound_s out of 0.7-1.3: {off} (all: {judged})"


def test_a_result_carries_its_largest_all_valid_size_and_refuses_one_without_etcds_cpu():
    def size(n: int, valid: int, invalid: int, etcd: float | None) -> dict:
        return {"nodes": n, "runs": [], "summary": {"valid_runs": valid, "invalid_runs": invalid,
                                                      "cpu_per_node_s": 0.005, "etcd_cpu_per_node_s": etcd}}

    result = {"results": {"a": size(64, 3, 0, 0.002), "b": size(256, 3, 0, 0.002),
                          "c": size(512, 1, 2, 0.003)}}
    carried = fleetreal.bound_at(result, 1000, 2, 2)
    assert carried["from_nodes"] == 256  # 512 saturated in two runs: the host's edge, not carried
    assert carried["cpu_bound_s"] == pytest.approx(1000 * 0.007 / 2, abs=1e-3)
    with pytest.raises(ValueError):
        fleetreal.bound_at({"results": {"a": size(64, 3, 0, None)}}, 1000, 2, 2)


def test_carrying_a_file_that_is_no_fleet_result_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert fleetreal.main(["--bound-from", str(bad), "--nodes", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetreal: cannot carry") and err.count("\n") == 1, err
    assert fleetreal.main(["--bound-from", str(tmp_path / "none.json"), "--nodes", "1000"]) == 2
    capsys.readouterr()
    good = Path(fleetreal.__file__).parent / "results" / "fleetreal-bound-aws.json"
    assert fleetreal.main(["--bound-from", str(good), "--nodes", ""]) == 2  # no size: no traceback
    assert capsys.readouterr().err.count("\n") == 1
