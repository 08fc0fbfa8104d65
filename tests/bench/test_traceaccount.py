"""bench/traceaccount.py on synthetic timelines: the goodput, loss and overhead arithmetic of a trace
replay, checked against figures worked out by hand (issues 28 and 43)."""

from __future__ import annotations

import pytest

from bench import traceaccount as ta
from tests.support.tracecases import T, hand_trace, steps


def test_steady_overhead_counts_every_undisturbed_stretch_not_only_the_first():
    # round 1: 50 clean steps; round 2: 50 steps with a 0.2 s stall every 10 (a checkpoint): 4 stalls
    rows = steps("a", 1, 0, 50, 0.0) + steps("a", 2, 50, 50, 100.0, stall_every=10, stall=0.2)
    f = ta.steady_overhead(sorted(rows, key=lambda r: r.ts), T, settle=0.0)
    useful = 49 * T + 49 * T
    elapsed = 49 * T + (49 * T + 4 * 0.2)
    assert f == pytest.approx(1 - useful / elapsed)
    assert f > 0.03


def test_a_gap_over_three_steps_ends_a_stretch_and_short_stretches_do_not_count():
    rows = steps("a", 1, 0, 20, 0.0) + steps("a", 1, 20, 5, 20.0)  # 16 s gap, then only 5 steps
    assert ta.steady_overhead(rows, T) == pytest.approx(0.0, abs=1e-9)  # the gap is an event's waste
    assert ta.steady_overhead(rows[:5], T) == 0.0  # nothing long enough to judge: no overhead claimed
    assert ta.steady_overhead(rows, 0.0) == 0.0


def test_account_keeps_the_last_execution_of_each_step_and_counts_redone_ones_as_lost():
    # 2 nodes x 60 s; round 1 runs steps 0-59, a loss, round 2 resumes from step 50 (10 redone) to 149,
    # its last step at 59.8 s
    rows = steps("a", 1, 0, 60, 0.0) + steps("a", 2, 50, 100, 40.0)
    lives = [ta.Life(0.0, 60.0), ta.Life(0.0, 60.0)]
    out = ta.account(rows, lives, 0.0, 60.0, time_scale=10.0)
    assert out.steps_run == 160 and out.steps_kept == 150 and out.steps_lost == 10
    assert out.reforms == 1
    assert out.step_time_s == pytest.approx(T)
    assert out.kept_node_s == pytest.approx(150 * 2 * T)  # kept steps x world x T
    assert out.lost_node_s == pytest.approx(10 * 2 * T)
    assert out.billed_node_s == pytest.approx(120.0)
    assert out.goodput_measured == pytest.approx(150 * 2 * T / 120.0, abs=1e-4)
    # the stall: step 59 at 11.8 s, step 50 again at 40 s: (28.2 - T) x world 2
    assert out.reform_node_s == pytest.approx((40.0 - 59 * T - T) * 2, abs=0.1)
    assert out.reforming_s == pytest.approx(40.0 - 59 * T, abs=1e-6)


def test_the_settle_transient_is_a_fixed_cost_paid_once_per_round():
    # round 2's first 25 steps take 0.5 s (the refill after a re-form), then T
    slow = [ta.Step(r.ts + 0.3 * min(i, 25), r.step, r.world, r.node, r.round)
            for i, r in enumerate(steps("a", 2, 150, 150, 100.0))]
    rows = steps("a", 1, 0, 150, 0.0) + slow
    out = ta.account(rows, [ta.Life(0.0, 200.0)], 0.0, 200.0, time_scale=10.0)
    # within the first 10 s of round 2 (steps ending by 110.0 s: 20 gaps of 0.5 s), 0.3 s over T each, x 2
    assert out.settle_node_s == pytest.approx(20 * 0.3 * 2, abs=1e-6)
    flat = ta.account(rows, [ta.Life(0.0, 200.0)], 0.0, 200.0, time_scale=10.0, settle=0.0)
    assert flat.goodput_measured == out.goodput_measured  # the replay itself is the same
    assert out.goodput_scaled > flat.goodput_scaled  # stretched by S it would recur all along


def test_lives_come_from_the_instance_events_and_run_from_launch_to_end():
    events = [
        {"ts": 10.0, "event": "instance.launched", "instance": "i-2", "boot_s": 9.0},
        {"ts": 0.0, "event": "instance.launched", "instance": "i-1", "boot_s": 0.0},
        {"ts": 19.0, "event": "instance.booted", "instance": "i-2"},
        {"ts": 10.0, "event": "instance.detached", "instance": "i-1"},
        {"ts": 30.0, "event": "instance.terminated", "instance": "i-1", "why": "self-terminated"},
        {"ts": 31.0, "event": "instance.reclaimed", "instance": "i-1"},  # the first end counts
    ]
    lives = {x.name: x for x in ta.lives_from_events(events, end=100.0)}
    assert lives["i-1"] == ta.Life(0.0, 30.0, None, "i-1")
    assert lives["i-2"] == ta.Life(10.0, 100.0, 19.0, "i-2")  # still running at the end: billed to it


def test_goodput_scaled_is_measured_at_scale_one_and_stretches_all_but_the_fixed_costs():
    assert ta.goodput_scaled(80.0, 100.0, 10.0, 1.0) == pytest.approx(0.8)
    # S = 10: kept 800, billed 10 x 90 + 10 = 910
    assert ta.goodput_scaled(80.0, 100.0, 10.0, 10.0) == pytest.approx(800 / 910)
    assert ta.goodput_scaled(0.0, 0.0, 0.0, 10.0) == 0.0


def test_goodput_scaled_matches_a_timeline_computed_by_hand():
    rows, lives = hand_trace()
    out = ta.account(rows, lives, 0.0, 100.0, time_scale=10.0)
    # B, billed: a 100 + b 60.5 + c 37 + d 75 + e 39.5 = 312 node-s
    assert out.billed_node_s == pytest.approx(312.0)
    # K, kept: steps 0-33 x 3 = 102, 34-57 x 3 = 72 (58, 59 of round 2 were redone), 58-63 x 2 = 12,
    # 64-92 x 3 = 87: 273 node-s; 95 executions, 93 kept, 2 lost
    assert (out.steps_run, out.steps_kept, out.steps_lost, out.reforms) == (95, 93, 2, 3)
    assert out.kept_node_s == pytest.approx(273.0)
    # F, fixed costs: stalls (gap - T) x the world after: (2-1) x 3 + (4-1) x 2 + (2-1) x 3 = 12;
    # lost steps 2 x 3 x T = 6; no settle transient (every step takes T): F = 18
    assert out.reform_node_s == pytest.approx(12.0)
    assert out.lost_node_s == pytest.approx(6.0)
    assert out.settle_node_s == pytest.approx(0.0)
    # The compressed rest, B - K - F = 21, node by node from the rank-0 world: d booting 25-34 (9),
    # c idle after its leave 34-37 (3), e booting 60.5-69.5 and waiting for the round at 70 (9.5),
    # b counted by rank 0 in the world until 61 but gone at 60.5 (-0.5): 9 + 3 + 9.5 - 0.5 = 21.
    assert out.compressed_node_s == pytest.approx(21.0)
    # Real time, S = 10: the boots take 90 s each, c idles 30 s, every training stretch is 10 times
    # longer (kept 2730 node-s); the three stalls and the two redone steps cost what they cost here (18).
    # billed = 10 x (273 + 21) + 18 = 2958 node-s; goodput = 2730 / 2958 = 0.92292
    assert out.goodput_scaled == pytest.approx(2730 / 2958, abs=1e-4)
    assert out.goodput_scaled == pytest.approx(0.9229, abs=1e-4)
    assert out.billed_node_h_scaled == pytest.approx(2958 / 3600, abs=1e-3)
    # The replay as run: 273 / 312
    assert out.goodput_measured == pytest.approx(0.875)
    # Before issue 43 the simulated figure kept B - K = 39 as the events' waste and stretched only the
    # undisturbed time: 1 - 39 / (10 x 312) = 0.9875 (run against that function, it gave 0.9875; with
    # its after-the-run boot arithmetic, 2 launches x (90 - 9) s more, 0.9388). This figure must not.
    assert abs(out.goodput_scaled - 0.9875) > 0.05 and abs(out.goodput_scaled - 0.9388) > 0.01


def test_a_leaver_that_ends_its_instance_at_the_hand_off_is_billed_less():
    rows, lives = hand_trace()
    ended = [ta.Life(0.0, 34.0, name="c") if x.name == "c" else x for x in lives]
    before = ta.account(rows, lives, 0.0, 100.0, time_scale=10.0)
    after = ta.account(rows, ended, 0.0, 100.0, time_scale=10.0)
    assert after.billed_node_s == pytest.approx(before.billed_node_s - 3.0)
    # 3 node-s less at 10x: 2730 / 2928
    assert after.goodput_scaled == pytest.approx(2730 / 2928, abs=1e-4)


def test_a_round_formed_before_the_window_pays_no_settle_transient():
    slow = [ta.Step(r.ts + 0.3 * min(i, 25), r.step, r.world, r.node, r.round)
            for i, r in enumerate(steps("a", 1, 0, 150, 0.0))]
    assert ta.account(slow, [ta.Life(0.0, 60.0)], 0.0, 60.0, time_scale=10.0).settle_node_s > 0
    # the replay starts with the job already training: its first round is not an event's
    assert ta.account(slow, [ta.Life(0.0, 60.0)], 0.4, 60.0, time_scale=10.0).settle_node_s == 0.0
