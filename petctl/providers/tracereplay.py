"""`petctl chaos NAME --trace FILE`: a spot trace played against a running job, through the provider's
chaos capability (notice, kill, rebalance) and, where it has one, its capacity hold (`hold_capacity`:
the local provider's reconciler launches nothing until then). The plan is petctl.core.spottrace's
(pure); this is the clock and the calls. Slots map to the job's running instances in launch order,
skipping those with a pending notice. Boot time is the reconciler's `--replace-delay`: a replacement is
launched at once and its agent starts that much later, in replayed seconds. To replay a boot of B
simulated seconds, start the job with `--replace-delay B/S` (S the trace's `time_scale`; 9 for a 90 s boot
at 10x), as bench/run.py's `--boot` does for the bench's own group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from petctl.core.errors import PetctlError
from petctl.core.spottrace import Action, Trace, due, pick_slot, plan


def replay(provider: Any, name: str, trace: Trace, echo: Callable[[str], None] = print,
           clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> int:
    """Play every action at its time; returns how many were skipped (no instance fit, say). Raises
    PetctlError when the job is gone (its instances cannot be listed)."""
    actions = plan(trace)
    t0, done, skipped = clock(), 0, 0
    sent: dict[int, str] = {}  # event -> instance (a rebalance's notice goes to the same one)
    while done < len(actions):
        batch, done = due(actions, done, clock() - t0)
        for a in batch:
            try:
                echo(_one(provider, name, a, t0, sent))
            except PetctlError as e:  # this action cannot happen now (no running instance): say so, go on
                skipped += 1
                echo(f"{clock() - t0:7.1f}s {a.what}: skipped ({e})")
        if done < len(actions):
            sleep(max(0.0, min(0.5, actions[done].at - (clock() - t0))))
    return skipped


def _one(provider: Any, name: str, a: Action, t0: float, sent: dict[int, str]) -> str:
    at = f"{a.at:7.1f}s"
    if a.what == "hold":
        hold = getattr(provider, "hold_capacity", None)
        if hold is None:
            return f"{at} hold: this provider cannot withhold capacity (skipped)"
        hold(name, t0 + a.until)
        return f"{at} hold: no capacity until +{a.until:.1f}s"
    running = sorted((h for h in provider.hosts(name) if h.state == "running"),
                     key=lambda h: h.launched_at or 0)
    if a.node is None:  # an outage: every running instance gets the notice
        ids = [provider.terminate_host(name, h.host_id, mode="notice", grace=a.grace) for h in running]
        return f"{at} outage: notice to {', '.join(ids) or 'no instance'} (grace {a.grace:.1f}s)"
    host = sent.get(a.event) if a.what == "notice" else None
    if host is None:
        host = pick_slot(a.node, [h.host_id for h in running])
    if host is None:
        raise PetctlError("no running instance")
    mode = {"kill": "kill", "rebalance": "rebalance", "notice": "notice"}[a.what]
    done = provider.terminate_host(name, host, mode=mode, grace=a.grace)
    sent[a.event] = done
    return f"{at} {mode}: {done}" + (f" (grace {a.grace:.1f}s)" if mode != "kill" else "")
