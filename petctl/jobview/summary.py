"""One summary of a job's accounting for `status`, `jobs` and `report`: goodput, lost work and cost.

Kept apart from the CLI so every command shows the same numbers computed the same way.
"""

from __future__ import annotations

from typing import Any

from petctl.core.errors import PetctlError
from petctl.jobview.view import JobView


def summarize(view: JobView, running: bool) -> dict[str, Any]:
    """Goodput, lost steps, restarts and cost from the job's timeline. A timeline or price that cannot be
    read is reported in the summary (`events_error`, `cost_error`), never raised: it must not hide the
    status it accompanies."""
    try:
        events, events_error = view.events(), ""
    except PetctlError as e:  # the mirror is unreadable right now (permissions, network)
        events, events_error = [], str(e)
    acc = view.accounting(events, running)
    try:
        cost, cost_error = view.cost(events, running), ""
    except PetctlError as e:  # prices are a nicety: say why they are missing
        cost, cost_error = None, str(e)
    return {"goodput": acc.goodput, "goodput_note": acc.goodput_note, "steps_reported": acc.steps_reported,
            "steps_kept": acc.steps_kept, "steps_lost": acc.steps_lost,
            "restarts": acc.restarts, "failure_restarts": acc.failure_restarts,
            "preemption_notices": acc.preemption_notices, "reform_seconds": acc.reform_seconds,
            "instance_hours": acc.instance_seconds / 3600.0,
            "cost": cost.to_dict() if cost is not None else None, "cost_error": cost_error,
            "events_error": events_error}


def one_line(summary: dict[str, Any]) -> str:
    goodput = summary["goodput"]
    note = summary.get("goodput_note") or ""
    parts = [f"goodput {goodput:.0%}" if goodput is not None else
             f"goodput n/a ({note})" if note else "goodput n/a",
             f"{summary['steps_lost']} steps lost" if summary.get("steps_reported", True) else
             "steps lost n/a", f"{summary['restarts']} restarts",
             f"{summary['reform_seconds']:.1f}s re-forming",
             f"{summary['instance_hours']:.2f} instance-hours"]
    parts.append(cost_text(summary.get("cost")))
    return ", ".join(parts)


def cost_text(cost: dict[str, Any] | None) -> str:
    if not cost or cost.get("total") is None:
        return "cost n/a" if not cost else f"cost unknown ({cost.get('note')})"
    text = f"cost ${cost['total']:.2f}"
    if cost.get("on_demand_total") is not None and cost.get("saving_pct") is not None:
        text += f" vs ${cost['on_demand_total']:.2f} on demand ({cost['saving_pct']:.0%} saved)"
    return text + (" (estimate)" if cost.get("estimate") else "")
