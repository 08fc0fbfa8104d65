"""One summary of a job's accounting for `status`, `jobs` and `report`: goodput, lost work and cost.

Kept apart from the CLI so every command shows the same numbers computed the same way.
"""

from __future__ import annotations

from typing import Any

from petctl.core.errors import PetctlError
from petctl.jobview.accounting import NO_STEPS
from petctl.jobview.view import JobView

# Goodput's note while the nodes publish steps but no round that had any has ended yet.
NO_ROUND_ENDED = "counted once a round that trained has ended"


def summarize(view: JobView, running: bool, live_steps: bool = False) -> dict[str, Any]:
    """Goodput, lost steps, re-forms and cost from the job's timeline. A timeline or price that cannot be
    read is reported in the summary (`events_error`, `cost_error`), never raised: it must not hide the
    status it accompanies.

    What is not known is None (n/a), never 0: goodput, kept and lost steps without any step line.
    `live_steps`: a node publishes a step now, so the script does report steps, even before any round
    that had them has ended (the timeline only has ended rounds' steps).
    `restarts` is kept for older readers and means `reforms` (the round's failure count is the status's
    own `failure_restarts`)."""
    try:
        events, events_error = view.events(), ""
    except PetctlError as e:  # the mirror is unreadable right now (permissions, network)
        events, events_error = [], str(e)
    acc = view.accounting(events, running)
    try:
        cost, cost_error = view.cost(events, running), ""
    except PetctlError as e:  # prices are a nicety: say why they are missing
        cost, cost_error = None, str(e)
    reported = acc.steps_reported or live_steps
    note = NO_ROUND_ENDED if live_steps and acc.goodput_note == NO_STEPS else acc.goodput_note
    return {"goodput": acc.goodput, "goodput_note": note, "steps_reported": reported,
            "steps_kept": acc.steps_kept if reported else None,
            "steps_lost": acc.steps_lost if reported else None,
            "steps_lost_lower_bound": acc.steps_lost_lower_bound,
            "reforms": acc.reforms, "failure_restarts": acc.failure_restarts,
            "preemption_notices": acc.preemption_notices, "reform_seconds": acc.reform_seconds,
            "reform_basis": acc.reform_basis, "reform_lower_bound": acc.reform_lower_bound,
            "instance_hours": acc.instance_seconds / 3600.0, "billing_basis": acc.billing_basis,
            "cost": cost.to_dict() if cost is not None else None, "cost_error": cost_error,
            "events_error": events_error}


def one_line(summary: dict[str, Any]) -> str:
    goodput = summary["goodput"]
    note = summary.get("goodput_note") or ""
    parts = [f"goodput {goodput:.0%}" if goodput is not None else
             f"goodput n/a ({note})" if note else "goodput n/a",
             f"{'>= ' if summary.get('steps_lost_lower_bound') else ''}{summary['steps_lost']} steps lost"
             if summary.get("steps_lost") is not None else
             "steps lost n/a", reforms_text(summary.get("reforms", 0),
                                           summary.get("failure_restarts", 0)),
             reforming_text(summary['reform_seconds'], summary.get("reform_basis") == "rounds"),
             f"{summary['instance_hours']:.2f} instance-hours{basis_text(summary.get('billing_basis'))}"]
    parts.append(cost_text(summary.get("cost")))
    return ", ".join(parts)


BASIS_TEXT = {"provider": "launch to end",
              "agents": "agent uptime: the provider has no record of its instances",
              "provider+agents": "launch to end; agent uptime where the provider has no record"}


def basis_text(basis: str | None) -> str:
    """" (launch to end)": what the instance time counts (accounting.py `billing_basis`)."""
    return f" ({BASIS_TEXT[basis]})" if basis in BASIS_TEXT else ""


def reforming_text(seconds: float, lower_bound: bool) -> str:
    """"12.0s re-forming": from the disruption to training again; for a script that reports no steps
    "≥0.5s re-forming (lower bound: ...)", since only the workers' restart is seen, not training."""
    if not lower_bound:
        return f"{seconds:.1f}s re-forming"
    return f"≥{seconds:.1f}s re-forming (lower bound: until workers restarted, not training)"


def reforms_text(reforms: int, failure_restarts: int) -> str:
    """"3 re-forms (1 failure restart)": every round opened after the first, and how many of them a
    worker failure opened (those count against --max-restarts)."""
    text = f"{reforms} re-form{'' if reforms == 1 else 's'}"
    if failure_restarts:
        text += f" ({failure_restarts} failure restart{'' if failure_restarts == 1 else 's'})"
    return text


def cost_text(cost: dict[str, Any] | None) -> str:
    if not cost or cost.get("total") is None:
        return "cost n/a" if not cost else f"cost unknown ({cost.get('note')})"
    text = f"cost ${cost['total']:.2f}"
    if cost.get("on_demand_total") is not None and cost.get("saving_pct") is not None:
        text += f" vs ${cost['on_demand_total']:.2f} on demand ({cost['saving_pct']:.0%} saved)"
    sources = sorted({str(x.get("source")) for x in cost.get("lines") or [] if x.get("source")})
    text += " (estimate)" if cost.get("estimate") else ""
    return text + (f" [prices: {'; '.join(sources)}]" if sources else "")
