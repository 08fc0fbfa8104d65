"""What a user gets when the rendezvous store fails under a running job, read from the node logs.

Both systems run `workload.py`, which prints one `train.step` line per step (with `restart` =
`TORCHELASTIC_RESTART_COUNT`, which petctl's agent sets too) and checkpoints every 10 steps, so the same
figures are taken from either system's logs, cut at `t_fault` (the SIGSTOP or SIGKILL of the store):

- `restarts`: worker restarts after the fault: the rise of `restart` in the steps, or (if larger) the
  system's own count: petctl's new rounds (`workers.started` after the fault), torchrun's "will restart
  worker group" lines (most on one node).
- `steps_lost`: as in P1/P2 (`phases.steps_lost`) when the workers resumed from a checkpoint; 0 when
  they never stopped; None when the job stopped training and never resumed (nothing to count yet: the
  loss is the whole job's future).
- `longest_pause_s`: the longest time any node went without a step between the fault and the end of the
  observation (the end counts: a job that stopped paused until then).
- `training_after`: every node ran a step at the full world size between `t_fault + check_after` and
  the end of the observation.
- `alive`: which node processes (petctl agents, torchrun agents) were still running at the end.
"""

from __future__ import annotations

from typing import Any

from bench import phases
from bench.procs import Node

PETCTL_COUNTS = ("rendezvous.restart", "membership.lost", "store.unreachable", "store.reachable",
                 "store.rebuilt", "agent.fenced", "agent.crashed")


def _restart_value(event: dict[str, Any]) -> int:
    try:
        return int(event.get("restart", 0))
    except (TypeError, ValueError):
        return 0


def step_restarts(nodes: list[Node], t_fault: float) -> int:
    """How far `TORCHELASTIC_RESTART_COUNT` rose in the steps after the fault (0 if no step came)."""
    before = [_restart_value(e) for n in nodes for e in n.events("train.step") if float(e["ts"]) < t_fault]
    after = [_restart_value(e) for n in nodes for e in n.events("train.step", after=t_fault)]
    if not after:
        return 0
    return max(0, max(after) - (max(before) if before else 0))


def system_restarts(nodes: list[Node], t_fault: float, system: str) -> int:
    """The system's own count of restarts after the fault: petctl's new rounds, torchrun's restarts."""
    if system == "petctl":
        return len({e.get("round") for n in nodes for e in n.events("workers.started", after=t_fault)})
    return max((len(n.events("torchrun.detect", after=t_fault)) for n in nodes), default=0)


def longest_pause(nodes: list[Node], t_fault: float, t_end: float) -> float:
    """The longest stretch of [t_fault, t_end] in which some node ran no step."""
    worst = 0.0
    for node in nodes:
        marks = [t_fault, *sorted(float(e["ts"]) for e in node.events("train.step", after=t_fault)
                                  if float(e["ts"]) <= t_end), t_end]
        worst = max(worst, max(b - a for a, b in zip(marks, marks[1:], strict=False)))
    return round(worst, 3)


def training_after(nodes: list[Node], world: int, since: float, until: float) -> bool:
    """Every node ran a step at `world` in [since, until]."""
    return all(any(int(e.get("world_size", 0)) == world and float(e["ts"]) <= until
                   for e in n.events("train.step", after=since)) for n in nodes)


def lost_steps(nodes: list[Node], world: int, t_fault: float, trained: bool) -> int | None:
    """Steps redone after the fault (see the module doc); None when the job stopped and never resumed."""
    lost = phases.steps_lost(nodes, world, t_fault)
    if lost is not None:
        return lost
    resumed = any(n.events("train.resume", after=t_fault) for n in nodes)
    return 0 if trained and not resumed else None


def last_error_line(node: Node, limit: int = 160) -> str:
    """The last line of a node's log that names an error (a dead torchrun's reason), shortened."""
    try:
        lines = node.log.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"log unreadable: {e}"
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line.strip()[:limit]
    return ""


def measure(nodes: list[Node], system: str, world: int, t_fault: float, check_after: float,
            t_end: float) -> dict[str, Any]:
    """Every figure of one run (module doc), plus the raw counts behind them."""
    trained = training_after(nodes, world, t_fault + check_after, t_end)
    out: dict[str, Any] = {
        "restarts": max(step_restarts(nodes, t_fault), system_restarts(nodes, t_fault, system)),
        "steps_lost": lost_steps(nodes, world, t_fault, trained),
        "longest_pause_s": longest_pause(nodes, t_fault, t_end),
        "training_after": trained,
        "alive": {n.name: n.alive for n in nodes},
        "exit_codes": {n.name: n.proc.returncode for n in nodes if not n.alive},
    }
    names = PETCTL_COUNTS if system == "petctl" else ("torchrun.detect",)
    out["events"] = {name: sum(len(n.events(name, after=t_fault)) for n in nodes) for name in names}
    if system != "petctl":
        dead = [n for n in nodes if not n.alive]
        if dead:
            out["last_error"] = {n.name: last_error_line(n) for n in dead}
    return out
