"""bench/report.py turns a run's results into the table README quotes: every recovery key a run can write
gets its rows, in a stable order, with its own goal (the framework and burst runs of issue 25 rendered an
empty table once: their keys were not in a fixed list)."""

from __future__ import annotations

from bench.report import BURST_GOAL, FRAMEWORK_GOAL, build_rows, recovery_keys


def _summary(median: float, p90: float | None = None) -> dict:
    seconds = {"n": 3, "min": median - 0.1, "median": median, "max": median + 0.1}
    if p90 is not None:
        seconds["p90"] = p90
    return {"seconds": seconds, "steps_lost": {"n": 3, "min": 0, "median": 0, "max": 0}}


def test_every_recovery_key_gets_rows_in_order_with_its_goal() -> None:
    results = {key: {"summary": {"petctl": _summary(1.0, 1.5), "torchrun-c10d": _summary(10.0)}}
               for key in ("P1-lightning", "P2", "P1-user-burst", "P1-hf", "P1", "P1-user", "P3-user")}
    assert recovery_keys(results) == ["P1", "P1-user", "P1-user-burst", "P1-hf", "P1-lightning", "P2",
                                      "P3-user"]
    rows = build_rows(results)
    main = {r["scenario"]: r for r in rows if r["system"] == "petctl" and r["unit"] == "s"}
    assert set(main) == set(results)
    assert main["P1-hf"]["goal"] == FRAMEWORK_GOAL and "HF Trainer" in main["P1-hf"]["metric"]
    assert main["P1-user-burst"]["goal"] == BURST_GOAL and "p90 1.5 s" in main["P1-user-burst"]["note"]
    assert main["P1"]["goal"].startswith("<= 3 s") and "p90" not in main["P1"]["note"]
    assert main["P1-hf"]["ratios"]["torchrun-c10d"] == "0.10"
    lost = [r for r in rows if r["scenario"] == "P1-hf" and r["unit"] == "steps" and r["system"] == "petctl"]
    assert lost and lost[0]["goal"] == "0", lost


class _Node:
    """A bench node's events, as bench/procs.Node returns them."""

    def __init__(self, *events: dict) -> None:
        self._events = events

    def events(self, name: str | None = None) -> list[dict]:
        return [e for e in self._events if name is None or e["event"] == name]


def test_p5_entry_is_each_rendezvous_start_and_the_like_for_like_row_compares_it() -> None:
    from bench.scenarios.rendezvous import _last_entry

    # Node a entered at 100.0 (ranked 100.5 after 0.5 s); node b entered at 100.8 (ranked 101.0).
    a = _Node({"event": "agent.started", "ts": 99.0},
              {"event": "rendezvous.complete", "ts": 100.5, "seconds": 0.5},
              {"event": "rendezvous.complete", "ts": 200.0, "seconds": 0.1})  # a later round: not read
    b = _Node({"event": "agent.started", "ts": 99.5},
              {"event": "rendezvous.complete", "ts": 101.0, "seconds": 0.2})
    assert _last_entry([a, b]) == 100.8
    # torchrun's line carries no `seconds`: its up line is its entry, so there is none to derive.
    assert _last_entry([a, _Node({"event": "rendezvous.complete", "ts": 101.0})]) is None

    def summary(rdzv: float, entered: float) -> dict:
        return {"rdzv_s": {"n": 5, "min": rdzv, "median": rdzv, "max": rdzv},
                "entered_s": {"n": 5, "min": entered, "median": entered, "max": entered},
                "launch_to_workers_s": {"n": 5, "min": 1, "median": 1, "max": 1}}

    results = {"P5": {"sizes": [64], "summary": {"petctl/N=64": summary(3.0, 1.2),
                                                 "torchrun-c10d/N=64": summary(1.5, 1.5)}}}
    rows = [r for r in build_rows(results) if r["scenario"] == "P5" and r["system"] == "petctl"]
    by_metric = {r["metric"]: r for r in rows}
    assert by_metric["N=64 rendezvous (all agents up -> all ranked)"]["ratios"]["torchrun-c10d"] == "2.00"
    assert by_metric["N=64 rendezvous (all in their first rendezvous -> all ranked)"]["ratios"] == {
        "torchrun-c10d": "0.80"}


def test_p5_counts_what_a_ranked_node_spends_starting_its_worker() -> None:
    from bench.scenarios.rendezvous import agent_cpu, worker_cpu

    # The agent had used 0.30 s when ranked and 0.31 s when its worker started; the worker 0.02 s at its
    # line. A torchrun node has only the worker's line.
    a = _Node({"event": "agent.started", "ts": 0.5, "cpu_s": 0.22},
              {"event": "rendezvous.complete", "ts": 1.0, "cpu_s": 0.30, "rdzv_cpu_s": 0.02},
              {"event": "workers.started", "ts": 1.1, "cpu_s": 0.31},
              {"event": "worker.trivial", "ts": 1.5, "cpu_s": 0.02})
    b = _Node({"event": "rendezvous.complete", "ts": 1.0, "cpu_s": 0.40, "rdzv_cpu_s": 0.02},
              {"event": "workers.started", "ts": 1.2, "cpu_s": 0.43},
              {"event": "worker.trivial", "ts": 1.6, "cpu_s": 0.04})
    spawn = agent_cpu([a, b])["ranked_to_workers"]
    assert (spawn["mean"], spawn["max"], spawn["n"]) == (0.02, 0.03, 2)
    split = agent_cpu([a, b])  # only `a` said its CPU at agent.started: b's agent is older
    assert (split["to_started"]["mean"], split["to_started"]["n"]) == (0.22, 1)
    assert (split["started_to_ranked"]["mean"], split["started_to_ranked"]["n"]) == (0.08, 1)
    assert worker_cpu([a, b]) == {"mean": 0.03, "max": 0.04, "n": 2}
    assert worker_cpu([_Node({"event": "worker.trivial", "ts": 1.0})]) == {}  # a worker older than the field

    size = {"n": 1, "min": 1, "median": 1, "max": 1}
    results = {"P5": {"sizes": [64], "summary": {
        "petctl/N=64": {"rdzv_s": size, "agent_cpu_ranked_to_workers_s": 0.008, "worker_cpu_s": 0.017},
        "torchrun-c10d/N=64": {"rdzv_s": size, "worker_cpu_s": 0.021}}}}
    rows = {(r["system"], r["metric"]): r for r in build_rows(results) if r["scenario"] == "P5"}
    metric = "N=64 CPU s per node, ranked -> worker's first line"
    assert rows[("petctl", metric)]["median"] == 0.025
    assert rows[("petctl", metric)]["note"].startswith("agent 0.008 s to start it, worker 0.017 s")
    assert rows[("torchrun-c10d", metric)]["median"] == 0.021
