"""The recovery phase breakdown (bench/phases.py), from synthetic node logs with known answers.

A user's script prints no start-up lines of its own, so its recovery is cut at the moments petctl.elastic's
`checkpoint.resumed` carries as fields; these check that those become milestones, that every milestone is
the slowest node's, and that a moment before the worker started (a warm worker that preloaded
petctl.elastic) costs nothing rather than vanishing.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import phases
from bench.procs import Node
from petctl.agent import warm_worker
from petctl.elastic import workerprotocol as startup

T = 1000.0  # the notice


def _node(tmp_path: Path, name: str, lines: list[dict]) -> Node:
    log = tmp_path / f"{name}.log"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return Node(name, None, log, T - 10)  # type: ignore[arg-type]  # no process: only the log is read


def _survivor(tmp_path: Path, name: str, lag: float, elastic_imported: float) -> Node:
    lines = [
        {"ts": T - 0.2, "event": "train.step", "step": 24, "rank": 0, "world_size": 3},
        {"ts": T + 0.1, "event": "preemption.notice"},
        {"ts": T + 0.4, "event": "workers.stopped"},
        {"ts": T + 0.5 + lag, "event": "rendezvous.complete", "world_size": 2},
        {"ts": T + 0.6 + lag, "event": "workers.started", "world_size": 2},
        {"ts": T + 1.2 + lag, "event": "checkpoint.resumed", "step": 25, "world_size": 2,
         "worker_started": T + 0.61 + lag, "elastic_imported": elastic_imported + lag,
         "comm_ready": T + 1.0 + lag, "resume_started": T + 1.1 + lag},
        {"ts": T + 1.21 + lag, "event": "train.resume", "step": 25, "world_size": 2},
        {"ts": T + 1.3 + lag, "event": "train.step", "step": 25, "rank": 0, "world_size": 2},
    ]
    return _node(tmp_path, name, lines)


def test_user_script_recovery_is_cut_at_petctl_elastic_moments(tmp_path: Path) -> None:
    nodes = [_survivor(tmp_path, "a", 0.0, T + 0.8), _survivor(tmp_path, "b", 0.05, T + 0.8)]
    marks = phases.milestones(nodes, 2, T)
    assert marks == {"detect": 0.1, "workers_stopped": 0.4, "rendezvous": 0.55, "workers_started": 0.65,
                     "elastic_imported": 0.85, "checkpointer_ready": 1.05, "checkpoint_loaded": 1.25,
                     "first_step": 1.35}
    sub = phases.sub_phases(marks)
    assert sub["elastic_imported"] == 0.2 and sub["checkpointer_ready"] == 0.2
    assert sub["checkpoint_loaded"] == 0.2 and sub["first_step"] == 0.1
    assert "torch_imported" not in sub  # the user's script prints no start-up lines
    assert phases.phase_durations(marks)["workers_started"] == round(1.05 - 0.55, 4)
    assert abs(phases.recovered_at(nodes, 2, T) - (T + 1.35)) < 1e-9
    assert phases.steps_lost(nodes, 2, T) == 0


def test_a_preloaded_petctl_elastic_counts_from_the_worker_start(tmp_path: Path) -> None:
    """Imported by the warm worker long before the notice: reached when the worker starts, not lost."""
    node = _survivor(tmp_path, "a", 0.0, T - 30.0)
    marks = phases.milestones([node], 2, T)
    assert marks["workers_started"] == 0.6 and marks["elastic_imported"] == 0.61  # its order came 10 ms later
    assert phases.sub_phases(marks)["elastic_imported"] == 0.01


def test_expand_keeps_the_fields_of_the_event_and_drops_what_came_before() -> None:
    resumed = {"ts": T + 2, "event": "checkpoint.resumed", "rank": 1, "world_size": 2,
               "worker_started": T + 1, "elastic_imported": T + 1.5, "comm_ready": None}
    out = phases.expand([{"ts": T - 1, "event": "train.step"}, resumed], T)
    assert [(e["event"], e["ts"], e["rank"]) for e in out] == [
        ("worker.proc_start", T + 1, 1), ("elastic.imported", T + 1.5, 1), ("checkpoint.resumed", T + 2, 1)]


def test_the_warm_worker_and_petctl_elastic_agree_on_the_order_variable() -> None:
    assert warm_worker.ENV_ORDER_TS == startup.ENV_ORDER_TS
    assert startup.worker_started_at({startup.ENV_ORDER_TS: "123.5"}) == 123.5
    started = startup.worker_started_at({})  # no order: this process's own start, from /proc
    assert started is None or 0 < started <= __import__("time").time()


def test_the_old_members_stall_is_the_longest_pause_between_two_worlds(tmp_path: Path) -> None:
    """P3: a node at world 3 steps until T+0.3 and again at world 4 at T+1.0; another pauses longer."""
    def member(name: str, last: float, first: float) -> Node:
        return _node(tmp_path, name, [
            {"ts": T - 0.1, "event": "train.step", "step": 40, "world_size": 3},
            {"ts": T + last, "event": "train.step", "step": 41, "world_size": 3},
            {"ts": T + first, "event": "train.step", "step": 42, "world_size": 4},
        ])
    nodes = [member("a", 0.3, 1.0), member("b", 0.2, 1.1)]
    assert phases.stall(nodes, 4, T) == 0.9
    assert phases.stall([*nodes, _node(tmp_path, "c", [])], 4, T) is None  # c not at world 4 yet


def test_every_survivor_knows_when_the_last_one_declared_the_loss_or_joined_the_next_round(tmp_path: Path):
    """P2's detection: a declares the loss at T+1.0; b learns of it by joining the round a opened."""
    a = _node(tmp_path, "a", [{"ts": T - 5, "event": "membership.lost"},  # an earlier loss: not this one
                              {"ts": T + 1.0, "event": "membership.lost"},
                              {"ts": T + 1.01, "event": "rendezvous.restart"}])
    b = _node(tmp_path, "b", [{"ts": T + 0.5, "event": "train.step", "step": 3, "world_size": 3},
                              {"ts": T + 1.05, "event": "rendezvous.joined"}])
    assert phases.milestones([a, b], 2, T)["detect"] == 1.0
    assert phases.all_know([a, b], T) == 1.05
    assert phases.all_know([a, b, _node(tmp_path, "c", [])], T) is None  # c has not heard yet
