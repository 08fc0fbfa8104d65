"""ElasticSampler: one global cursor, so every sample of an epoch is read once across world changes.

The rules are checked as pure functions (tables), then the class is driven through world histories the
way a job drives it: every rank of a round builds its sampler from the saved cursor, reads its steps, and
the cursor moves on per step. The end-to-end runs under the agent are in tests/e2e/test_data_exactly_once.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from petctl.elastic import Checkpointer, ElasticSampler, State
from petctl.elastic.sampler import (
    Cursor,
    advance,
    check_global_batch,
    plan_batches,
    rank_positions,
    reachable_worlds,
    step_starts,
)


# --- the plan ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("world", "kwargs", "expect"), [
    # (global, per_rank, micro, accumulation, fixed)
    (4, {"batch_size": 32}, (128, 32, 32, 1, False)),
    (3, {"batch_size": 32}, (96, 32, 32, 1, False)),
    (3, {"batch_size": 32, "micro_batch": 10}, (96, 32, 8, 4, False)),
    (2, {"global_batch": 24}, (24, 12, 12, 1, True)),
    (3, {"global_batch": 24, "micro_batch": 4}, (24, 8, 4, 2, True)),
    (4, {"global_batch": 24, "micro_batch": 4}, (24, 6, 3, 2, True)),  # 4 does not divide 6: 3 does
    (1, {"global_batch": 7, "micro_batch": 100}, (7, 7, 7, 1, True)),
])
def test_plan_splits_a_step(world, kwargs, expect):
    plan = plan_batches(world, 0, **kwargs)
    assert (plan.global_batch, plan.per_rank, plan.micro_batch, plan.accumulation, plan.fixed) == expect
    assert plan.micro_batch * plan.accumulation * world == plan.global_batch


@pytest.mark.parametrize(("world", "kwargs", "needle"), [
    (3, {"global_batch": 24, "batch_size": 8}, "not both"),
    (3, {}, "not both"),
    (5, {"global_batch": 24}, "does not split evenly over 5 ranks"),
    (2, {"batch_size": 0}, "batch_size must be at least 1"),
    (2, {"global_batch": 24, "micro_batch": 0}, "micro_batch must be at least 1"),
])
def test_plan_refuses_in_one_line(world, kwargs, needle):
    with pytest.raises(ValueError, match=needle) as err:
        plan_batches(world, 0, **kwargs)
    assert "\n" not in str(err.value)


def test_a_global_batch_some_reachable_world_cannot_split_is_refused_at_start():
    check_global_batch(24, [2, 3, 4])
    with pytest.raises(ValueError) as err:
        check_global_batch(24, [2, 3, 4, 5, 6, 7])
    msg = str(err.value)
    assert "world size 5, 7" in msg and "2..7" in msg and "multiple of 420" in msg and "\n" not in msg


def test_the_agents_min_and_max_are_the_reachable_worlds(monkeypatch):
    monkeypatch.setenv("PETCTL_MIN_WORLD_SIZE", "2")
    monkeypatch.setenv("PETCTL_MAX_WORLD_SIZE", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert reachable_worlds(3) == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="world size 5"):
        ElasticSampler(100, global_batch=24, rank=0, world_size=3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 ranks a node: 2, 4 (and this world)
    monkeypatch.setenv("PETCTL_MAX_WORLD_SIZE", "8")
    assert reachable_worlds(4) == [2, 4, 6, 8]
    monkeypatch.delenv("PETCTL_MIN_WORLD_SIZE")
    assert reachable_worlds(3) == [3]  # plain torchrun: this world only


# --- the cursor --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cursor", "batch", "drop_last", "after"), [
    (Cursor(0, 0), 10, False, Cursor(0, 10)),
    (Cursor(0, 95), 10, False, Cursor(1, 5)),  # the stream: the step took 5 of epoch 1
    (Cursor(0, 90), 10, False, Cursor(1, 0)),
    (Cursor(0, 80), 10, True, Cursor(0, 90)),
    (Cursor(0, 90), 10, True, Cursor(1, 0)),  # the last whole step of epoch 0
    (Cursor(0, 85), 10, True, Cursor(1, 0)),  # 85..94 read, the tail 95..99 skipped
    (Cursor(0, 95), 10, True, Cursor(1, 10)),  # a cursor in a tail too short for this world: skip it first
    (Cursor(0, 0), 250, False, Cursor(2, 50)),  # a batch larger than the dataset crosses two epochs
])
def test_advance(cursor, batch, drop_last, after):
    assert advance(cursor, batch, 100, drop_last) == after


def test_a_pass_is_the_steps_that_start_in_the_cursors_epoch():
    assert step_starts(Cursor(0, 70), 10, 100, False) == [Cursor(0, o) for o in (70, 80, 90)]
    assert step_starts(Cursor(0, 75), 10, 100, False)[-1] == Cursor(0, 95)  # reaches into epoch 1
    assert step_starts(Cursor(0, 75), 10, 100, True) == [Cursor(0, 75), Cursor(0, 85)]
    assert step_starts(Cursor(0, 95), 10, 100, True)[0] == Cursor(1, 0)  # the tail skipped: epoch 1


def test_ranks_read_their_stride_of_the_step():
    plan = plan_batches(3, 1, batch_size=4)
    assert rank_positions(Cursor(0, 90), plan, 100) == [Cursor(0, 91), Cursor(0, 94), Cursor(0, 97),
                                                          Cursor(1, 0)]


# --- the class, driven through world histories -------------------------------------------------------------
SIZE = 50


def history(worlds_steps: list[tuple[int, int]], **kwargs) -> list[list[int]]:
    saved = None
    out: list[list[int]] = []
    for world, steps in worlds_steps:
        saved, per_step = run_round_passes(saved, world, steps, **kwargs)
        out += per_step
    return out


def run_round_passes(saved: dict | None, world: int, steps: int, **kwargs) -> tuple[dict, list[list[int]]]:
    """As a training loop does it: one iterator per pass, a new one when a pass runs out."""
    samplers = [ElasticSampler(SIZE, rank=r, world_size=world, seed=7, **kwargs) for r in range(world)]
    for s in samplers:
        if saved is not None:
            s.load_state_dict(saved)
    iters = [iter(s) for s in samplers]
    per_step = []
    step = samplers[0].last_step if samplers[0].last_step is not None else -1
    while len(per_step) < steps:
        shares = []
        try:
            for s, it in zip(samplers, iters, strict=True):
                shares.append([next(it) for _ in range(s.plan.per_rank)])
        except StopIteration:  # every rank's pass ends at the same step
            assert not shares, "ranks' passes ended at different steps"
            iters = [iter(s) for s in samplers]
            continue
        # In the order of the stream: rank r's i-th sample is the step's position r + i x world.
        per_step.append([share[i] for i in range(len(shares[0])) for share in shares])
        step += 1
        for s in samplers:
            s.step_done(step)
    return samplers[0].state_dict(), per_step


@pytest.mark.parametrize("worlds", [
    [(4, 30)],
    [(4, 5), (3, 7), (4, 4), (2, 11), (3, 9)],  # scale down, up, down, up: each crosses an epoch now and then
    [(2, 3), (5, 2), (1, 13), (4, 12)],
])
def test_every_sample_of_every_epoch_once_across_world_changes(worlds):
    per_step = history(worlds, batch_size=3)
    flat = [i for step in per_step for i in step]
    full = len(flat) // SIZE
    assert full >= 2, "the history should cross at least two epochs"
    for e in range(full):
        assert sorted(flat[e * SIZE:(e + 1) * SIZE]) == list(range(SIZE)), f"epoch {e}"
    assert len(set(flat[full * SIZE:])) == len(flat) - full * SIZE  # the epoch in progress: no repeat


def test_the_same_cursor_reads_the_same_stream_at_any_world():
    """The global order is the world's to split, never to change: world 1 and a history of worlds read
    the same sequence of positions, step by step (the fixed-global-batch runs rely on it)."""
    one = history([(1, 20)], global_batch=12)
    mixed = history([(2, 5), (3, 5), (4, 5), (3, 5)], global_batch=12)
    assert [sorted(s) for s in one] == [sorted(s) for s in mixed]
    assert all(len(s) == 12 for s in mixed)


def test_drop_last_skips_only_the_tail_a_step_cannot_fill():
    per_step = history([(3, 4), (2, 10)], batch_size=4, drop_last=True)
    # 12 a step at world 3: 4 steps read 48 of epoch 0; its last 2 cannot fill a step of 8 at world 2.
    assert [len(s) for s in per_step] == [12] * 4 + [8] * 10
    epoch0 = [i for s in per_step[:4] for i in s]
    assert len(set(epoch0)) == 48
    epoch1 = [i for s in per_step[4:10] for i in s]  # 6 steps of 8 in epoch 1, its tail skipped
    assert len(set(epoch1)) == 48


def test_a_kill_rereads_exactly_the_redone_steps():
    """Saved after step 5; the round runs on to step 8 and dies; the next round, at another world,
    resumes from the save: the only indices read twice are those of steps 6..8."""
    saved, before = run_round_passes(None, 4, 6, batch_size=2)  # steps 0..5, saved
    _, lost = run_round_passes(saved, 4, 3, batch_size=2)  # steps 6..8, then killed: not saved
    _, after = run_round_passes(saved, 3, 40, batch_size=2)  # the survivors redo from step 6
    total = Counter(i for s in before + lost + after for i in s)
    reread = Counter(i for s in lost for i in s)
    clean = Counter(i for s in before + after for i in s)
    assert total - clean == reread
    stream = [i for s in before + after for i in s]
    for e in range(len(stream) // SIZE):
        assert sorted(stream[e * SIZE:(e + 1) * SIZE]) == list(range(SIZE))


def test_len_matches_the_pass_and_shrinks_after_a_resume():
    s = ElasticSampler(SIZE, batch_size=4, rank=1, world_size=3, seed=1)
    assert len(s) == len(list(s)) == 5 * 4  # 50 / 12: steps at 0, 12, 24, 36, 48 start in epoch 0
    for step in range(3):
        s.step_done(step)
    assert len(s) == len(list(s)) == 2 * 4
    s.set_epoch(9)  # frameworks call it; the cursor owns the epoch
    assert s.epoch == 0


def test_step_done_counts_each_step_once():
    s = ElasticSampler(SIZE, batch_size=5, rank=0, world_size=2)
    s.step_done(0)
    s.step_done(0)  # the Checkpointer and a framework callback both called it
    assert s.cursor == Cursor(0, 10)
    s.step_done(2)  # step 1's call was missed: the cursor still moves once per step
    assert s.cursor == Cursor(0, 30)


def test_an_iterator_made_before_the_resume_refuses_to_read_on():
    s = ElasticSampler(SIZE, batch_size=5, rank=0, world_size=2)
    stale = iter(s)
    next(stale)
    other = ElasticSampler(SIZE, batch_size=5, rank=0, world_size=2)
    other.step_done(0)
    s.load_state_dict(other.state_dict())
    with pytest.raises(RuntimeError, match="after Checkpointer.resume"):
        list(stale)


def test_a_cursor_saved_for_another_dataset_is_refused():
    saved = ElasticSampler(SIZE, batch_size=5, rank=0, world_size=2, seed=3).state_dict()
    with pytest.raises(ValueError, match="different dataset or order") as err:
        ElasticSampler(SIZE + 1, batch_size=5, rank=0, world_size=2, seed=3).load_state_dict(saved)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="different dataset or order"):
        ElasticSampler(SIZE, batch_size=5, rank=0, world_size=2, seed=4).load_state_dict(saved)


def test_a_prefetching_loader_does_not_move_the_cursor():
    """DataLoader workers read ahead of training; only a done step moves the cursor, so a save mid-pass
    holds the position of the last step trained, not of the last batch prefetched."""
    data = list(range(SIZE))
    s = ElasticSampler(data, batch_size=5, rank=0, world_size=1, shuffle=False)
    loader = DataLoader(data, batch_size=s.plan.micro_batch, sampler=s, num_workers=2, prefetch_factor=4)
    seen = []
    for step, batch in enumerate(loader):
        seen += batch.tolist()
        s.step_done(step)
        if step == 2:
            break
    assert seen == list(range(15)) and s.cursor == Cursor(0, 15)


def test_step_end_moves_the_cursor_before_it_saves(tmp_path, monkeypatch):
    monkeypatch.setenv("PETCTL_CACHE_DIR", str(tmp_path / "cache"))
    url = (tmp_path / "ckpt").as_uri()
    model = torch.nn.Linear(2, 2)
    sampler = ElasticSampler(SIZE, batch_size=4, rank=0, world_size=1, seed=5)
    state = State(model=model, stateful={"sampler": sampler})
    with Checkpointer(url, every=3, background=False) as ckpt:
        assert ckpt.resume(state) == 0
        for step in range(6):
            ckpt.step_end(step, state)
    assert sampler.cursor == Cursor(0, 24)
    again = ElasticSampler(SIZE, batch_size=2, rank=1, world_size=3, seed=5)  # another world
    with Checkpointer(url, every=3, background=False) as ckpt:
        assert ckpt.resume(State(model=torch.nn.Linear(2, 2), stateful={"sampler": again})) == 6
    assert again.cursor == Cursor(0, 24) and again.last_step == 5


@pytest.mark.parametrize(("world", "rank", "batch", "cursor", "drop_last"), [
    (3, 2, 4, Cursor(0, 0), False),
    (3, 0, 4, Cursor(2, 41), False),  # the pass's last step reaches into epoch 3
    (4, 3, 20, Cursor(0, 10), False),  # a step of 80 of a 50-sample dataset spans three epochs
    (2, 1, 5, Cursor(1, 38), True),  # the tail of epoch 1 skipped: the pass is epoch 2's
])
def test_the_pass_reads_the_positions_the_rule_gives(world, rank, batch, cursor, drop_last):
    s = ElasticSampler(SIZE, batch_size=batch, rank=rank, world_size=world, seed=2, drop_last=drop_last)
    s.cursor = cursor
    starts = step_starts(cursor, world * batch, SIZE, drop_last)
    positions = [p for start in starts for p in rank_positions(start, s.plan, SIZE)]
    expected = [int(s.order(p.epoch)[p.offset]) for p in positions]
    assert list(s) == expected and len(s) == len(expected)


def test_endless_makes_a_pass_after_another_and_refuses_an_empty_loader():
    from petctl.elastic import endless

    s = ElasticSampler(10, batch_size=2, rank=0, world_size=1, shuffle=False)
    loader = DataLoader(list(range(10)), batch_size=2, sampler=s)
    batches = endless(loader)
    read = []
    for step in range(7):  # 5 steps an epoch: the sixth starts the next pass
        read += next(batches).tolist()
        s.step_done(step)
    assert read == list(range(10)) + [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="yielded no batch"):
        next(endless([]))
