"""The end-of-job report: a PNG timeline (world size and step over time, preemptions and restarts
marked) plus the accounting, because people would rather look at a job's life than read its log.

matplotlib is imported only here (the `report` extra), with the non-interactive Agg backend, so the
CLI stays light and the report renders on a headless machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from petctl.core.errors import PetctlError
from petctl.jobview.accounting import Accounting
from petctl.jobview.summary import reforming_text, reforms_text

MARKED = {  # event -> (legend label, colour)
    "preemption.notice": ("preemption notice", "tab:orange"),
    "membership.lost": ("node lost", "tab:red"),
    "workers.failed": ("worker failure", "black"),
    "rendezvous.restart": ("re-form", "tab:purple"),
}


def headline(job: str, acc: Accounting) -> str:
    """The chart's title: the same measures as `petctl status`'s line, n/a where no step was reported."""
    goodput = f"{acc.goodput:.0%}" if acc.goodput is not None else "n/a"
    floor = ">= " if acc.steps_lost_lower_bound else ""
    lost = f"{floor}{acc.steps_lost} steps lost" if acc.steps_reported else "steps lost n/a (no step events)"
    return (f"{job}: goodput {goodput}, {lost}, {reforms_text(acc.reforms, acc.failure_restarts)}, "
            f"{reforming_text(acc.reform_seconds, acc.reform_lower_bound)}")


def render_timeline(job: str, events: list[dict[str, Any]], acc: Accounting, out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PetctlError("the report needs matplotlib: pip install 'petctl[report]'") from e
    if not events:
        raise PetctlError(f"job {job!r} has no events to chart yet")
    t0 = min(float(e["ts"]) for e in events)
    t_last = max(float(e["ts"]) for e in events)  # a round still running lasts until the latest event
    fig, (ax_world, ax_step) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.5),
                                            gridspec_kw={"height_ratios": [1, 2]})
    # World size: a step function over the rounds' spans.
    xs, ys = [], []
    for r in acc.rounds:
        start = r.started - t0
        end = (r.ended or r.last_step_ts or (t_last if r is acc.rounds[-1] else r.started)) - t0
        xs += [start, end]
        ys += [r.world_size, r.world_size]
    ax_world.step(xs, ys, where="post", color="tab:blue")
    ax_world.set_ylabel("world size (nodes)")
    ax_world.set_ylim(0, max(ys or [1]) + 1)
    # Steps: each round's span as a line, so redone work shows up as an overlap.
    for r in acc.rounds:
        if None not in (r.first_step, r.last_step, r.first_step_ts, r.last_step_ts):
            ax_step.plot([r.first_step_ts - t0, r.last_step_ts - t0], [r.first_step, r.last_step],
                         color="tab:green", linewidth=2)
    for name, (label, color) in MARKED.items():
        times = [float(e["ts"]) - t0 for e in events if e.get("event") == name]
        for i, t in enumerate(times):
            for ax in (ax_world, ax_step):
                first = i == 0 and ax is ax_step
                ax.axvline(t, color=color, linestyle=":", linewidth=1, label=label if first else None)
    if not acc.steps_reported:
        ax_step.text(0.5, 0.5, "no step events: the script prints no train.step lines",
                     transform=ax_step.transAxes, ha="center", va="center", color="gray")
    ax_step.set_xlabel("seconds since the job started")
    ax_step.set_ylabel("training step")
    fig.suptitle(headline(job, acc))
    handles, labels = ax_step.get_legend_handles_labels()
    if handles:
        ax_step.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
