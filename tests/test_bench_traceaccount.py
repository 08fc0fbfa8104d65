"""bench/traceaccount.py on synthetic timelines: the goodput, loss and overhead arithmetic of a trace
replay, checked against figures worked out by hand (issue 28)."""

from __future__ import annotations

import pytest

from bench import traceaccount as ta

T = 0.2  # seconds per step


def steps(node: str, rnd: int, first_step: int, n: int, t0: float, world: int = 2, stall_every: int = 0,
          stall: float = 0.0) -> list[dict]:
    """`n` consecutive steps from `first_step` at T apart (plus `stall` after every `stall_every`th)."""
    out, ts = [], t0
    for i in range(n):
        out.append({"ts": ts, "step": first_step + i, "world_size": world, "node": node, "round": rnd})
        ts += T + (stall if stall_every and (i + 1) % stall_every == 0 else 0.0)
    return out


def test_steady_overhead_counts_every_undisturbed_stretch_not_only_the_first():
    # round 1: 50 clean steps; round 2: 50 steps with a 0.2 s stall every 10 (a checkpoint): 4 stalls
    rows = steps("a", 1, 0, 50, 0.0) + steps("a", 2, 50, 50, 100.0, stall_every=10, stall=0.2)
    tuples = sorted((r["ts"], r["step"], r["world_size"], r["node"], r["round"]) for r in rows)
    f = ta.steady_overhead(tuples, T, settle=0.0)  # every step counts (the settle rule: below)
    useful = 49 * T + 49 * T
    elapsed = 49 * T + (49 * T + 4 * 0.2)
    assert f == pytest.approx(1 - useful / elapsed)
    # the old estimate, from the window before the first event alone, would have said 0 here
    assert f > 0.03


def test_a_rounds_first_seconds_are_the_events_waste_not_steady_overhead():
    # two rounds of 150 steps; each starts with 25 slow steps (0.5 s: the refill after a re-form), 12.5 s
    slow = [dict(r, ts=r["ts"] + 0.3 * min(i, 25)) for i, r in enumerate(steps("a", 1, 0, 150, 0.0))]
    slow2 = [dict(r, ts=r["ts"] + 0.3 * min(i, 25)) for i, r in enumerate(steps("a", 2, 150, 150, 100.0))]
    rows = slow + slow2
    tuples = sorted((r["ts"], r["step"], r["world_size"], r["node"], r["round"]) for r in rows)
    # from 10 s into each round: step 20 on (at 10.0 s) is still slow up to step 25, then T exactly
    kept = [r for r in tuples if r[0] - (0.0 if r[4] == 1 else 100.0) >= ta.SETTLE_S]
    assert kept[0][1] == 20 and len(kept) == 2 * 130
    useful = 2 * 129 * T
    elapsed = 2 * (129 * T + 5 * 0.3)  # 5 slow steps (21-25) after the cut in each round
    assert ta.steady_overhead(tuples, T) == pytest.approx(1 - useful / elapsed)
    assert ta.steady_overhead(tuples, T) < 0.06 < ta.steady_overhead(tuples, T, settle=0.0)
    # in the simulated figure the transient is paid once per round, not stretched with the steady time
    lives = [ta.Life(0.0, 200.0)]
    settled = ta.account(rows, lives, 0.0, 200.0, time_scale=10.0, launches=0, boot_replayed=3.0,
                         boots={"3s": 3.0})
    stretched = ta.account(rows, lives, 0.0, 200.0, time_scale=10.0, launches=0, boot_replayed=3.0,
                           boots={"3s": 3.0}, settle=0.0)
    assert settled.goodput_measured == stretched.goodput_measured  # the replay itself is the same
    assert settled.goodput_sim["3s"] > stretched.goodput_sim["3s"]


def test_a_gap_over_three_steps_ends_a_stretch_and_short_stretches_do_not_count():
    rows = steps("a", 1, 0, 20, 0.0) + steps("a", 1, 20, 5, 20.0)  # 16 s gap, then only 5 steps
    tuples = sorted((r["ts"], r["step"], r["world_size"], r["node"], r["round"]) for r in rows)
    assert ta.steady_overhead(tuples, T) == pytest.approx(0.0, abs=1e-9)  # the gap is an event's waste
    assert ta.steady_overhead(tuples[:5], T) == 0.0  # nothing long enough to judge: no overhead claimed
    assert ta.steady_overhead(tuples, 0.0) == 0.0


def test_account_keeps_the_last_execution_of_each_step_and_counts_redone_ones_as_lost():
    # 2 nodes x 60 s; round 1 runs steps 0-59, a loss, round 2 resumes from step 50 (10 redone) to 149,
    # its last step at 59.8 s
    rows = steps("a", 1, 0, 60, 0.0) + steps("a", 2, 50, 100, 40.0)
    lives = [ta.Life(0.0, 60.0), ta.Life(0.0, 60.0)]
    out = ta.account(rows, lives, 0.0, 60.0, time_scale=10.0, launches=0, boot_replayed=3.0,
                     boots={"90s": 90.0})
    assert out.steps_run == 160 and out.steps_kept == 150 and out.steps_lost == 10
    assert out.step_time_s == pytest.approx(T)
    assert out.kept_node_s == pytest.approx(150 * 2 * T)  # kept steps x world x T
    assert out.instance_node_s == pytest.approx(120.0)
    assert out.goodput_measured == pytest.approx(150 * 2 * T / 120.0, abs=1e-4)
    assert out.steady_overhead == pytest.approx(0.0, abs=1e-6)  # every stretch ran at T exactly
    # no launches: the simulated figure stretches the undisturbed time by S and keeps the waste
    waste = 120.0 - 150 * 2 * T
    assert out.goodput_sim["90s"] == pytest.approx(1 - waste / (10 * 120.0), abs=1e-4)
    # the 28.2 s without a step (11.8 s to 40 s) is re-forming; the 0.2 s tail is not
    assert out.reforming_s == pytest.approx(40.0 - 59 * T, abs=1e-6)


def test_a_slower_boot_bills_idle_instance_time_for_each_launch():
    rows = steps("a", 1, 0, 400, 0.0)
    lives = [ta.Life(0.0, 80.0), ta.Life(0.0, 80.0)]
    fast = ta.account(rows, lives, 0.0, 80.0, time_scale=1.0, launches=2, boot_replayed=3.0,
                      boots={"3s": 3.0, "180s": 180.0})
    extra = 2 * (180.0 - 3.0)
    assert fast.instance_hours_sim["180s"] == pytest.approx((160.0 + extra) / 3600, abs=1e-3)
    assert fast.goodput_sim["180s"] < fast.goodput_sim["3s"]
