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
