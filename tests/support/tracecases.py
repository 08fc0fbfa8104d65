"""Synthetic trace-replay timelines for bench/traceaccount.py's tests: rank 0's steps and the billed
lives of a small trace worked out by hand (issue 43)."""

from __future__ import annotations

from bench import traceaccount as ta

T = 0.2  # seconds per step


def steps(node: str, rnd: int, first_step: int, n: int, t0: float, world: int = 2, stall_every: int = 0,
          stall: float = 0.0, t: float = T) -> list[ta.Step]:
    """`n` consecutive steps from `first_step` at `t` apart (plus `stall` after every `stall_every`th)."""
    out, ts = [], t0
    for i in range(n):
        out.append(ta.Step(ts, first_step + i, world, node, rnd))
        ts += t + (stall if stall_every and (i + 1) % stall_every == 0 else 0.0)
    return out


def hand_trace() -> tuple[list[ta.Step], list[ta.Life]]:
    """A notice, a silent loss and two boots, 3 nodes, T = 1 s, S = 10, window [0, 100] replay seconds.

    Instances (billed lives, replay seconds):
      a  [0, 100]      rank 0 throughout
      b  [0, 60.5]     lost without a notice at 60.5
      c  [0, 37]       noticed at 25 (grace 120 s / 10 = 12 s: reclaim at 37); left the world at the
                       hand-off at 34, billed until 37: 3 s idle after the leave
      d  [25, 100]     c's replacement, launched at the notice, booted at 34 (90 s / 10 = 9 s)
      e  [60.5, 100]   b's replacement, launched at the loss, booted at 69.5
    Rank 0's steps (each step's time is T = 1 s; ts is when it ended):
      round 1  steps 0-33  at ts 0-33   world 3 (a, b, c)
      round 2  steps 34-59 at ts 35-60  world 3 (a, b, d): the hand-off, one re-form (gap 33 -> 35)
      round 3  steps 58-63 at ts 64-69  world 2 (a, d): b lost; 58 and 59 redone (gap 60 -> 64)
      round 4  steps 64-92 at ts 71-99  world 3 (a, d, e): e joins (gap 69 -> 71)
    """
    rows = (steps("a", 1, 0, 34, 0.0, world=3, t=1.0) + steps("a", 2, 34, 26, 35.0, world=3, t=1.0)
            + steps("a", 3, 58, 6, 64.0, world=2, t=1.0) + steps("a", 4, 64, 29, 71.0, world=3, t=1.0))
    lives = [ta.Life(0.0, 100.0, name="a"), ta.Life(0.0, 60.5, name="b"), ta.Life(0.0, 37.0, name="c"),
             ta.Life(25.0, 100.0, 34.0, "d"), ta.Life(60.5, 100.0, 69.5, "e")]
    return rows, lives
