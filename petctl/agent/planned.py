"""Planned membership changes save first: pure decisions for the round runner (roundrunner.py).

A membership change we choose (admitting a waiting node, a graceful leave such as `petctl scale` down or a
SIGTERM of the agent) need not throw away the steps since the last periodic checkpoint. Before the old
round's workers are stopped, the node that causes the change puts a save-now request on the round
(`Round.preempt`, the same record a spot notice uses); every member flags its workers through
`<control>/preempt`, the ranks agree on one step in the all-reduce `petctl.elastic` already runs, save it
and exit 0. Only then does the round re-form, and everyone resumes from that step: nothing is redone.

Unplanned changes (a node lost, a worker failure) cannot save first: a lost peer blocks every collective.
Scripts that do not speak the protocol (no `elastic.<rank>` marker: plain torchrun scripts) keep today's
behaviour: their workers get SIGTERM, as torchrun sends.
"""

from __future__ import annotations

from dataclasses import dataclass

from petctl.core.records import Preempt


@dataclass(frozen=True)
class SaveLook:
    """What the node sees when it wants a planned change."""

    node_id: str
    request: Preempt | None  # the round's save-now request, if any
    protocol: bool  # every local worker speaks the save-now protocol (petctl.elastic)
    running: bool  # our workers still run (nothing to save once they exited)
    saved: bool  # our workers reported the requested save, exited, or its deadline passed
    finished: bool = False  # a worker of ours exited 0 outside a save: the job's training is over


@dataclass(frozen=True)
class RequestSave:
    """CAS this request onto the round; the workers save, then the round re-forms."""

    request: Preempt


@dataclass(frozen=True)
class Reform:
    """Open the next round now (nothing to save, or the save is done)."""


@dataclass(frozen=True)
class Hold:
    """A save is under way: keep the round until it is done (or its asker re-forms it)."""


PlannedStep = RequestSave | Reform | Hold


def admission(look: SaveLook, cause: str | None, wall: float, budget: float) -> PlannedStep:
    """The admitting node's next step; `cause` when a waiting node can join now (the judge's
    `membership.waiting`), else None.

    No request yet: ask every member to save first (when our workers speak the protocol and run), else
    re-form at once as before. Our own request: hold until our workers saved (every rank saved the same
    step: the save's broadcast is its barrier), then re-form, even if the waiting node has gone since
    (our workers exited after the save: only a new round trains again). Someone else's request (a notice,
    a leave): hold; the round they re-form admits the waiting node too. Workers that finished (exited 0
    with no save asked) are never re-formed for a waiting node: hold, and the job ends.
    """
    request = look.request
    if request is None:
        if cause is None or look.finished:  # finished workers: re-forming would only restart them
            return Hold()
        if look.protocol and look.running:
            return RequestSave(Preempt(node_id=look.node_id, deadline=wall + budget, reason=cause,
                                       leaves=False))
        return Reform()
    if request.node_id == look.node_id and not request.leaves:
        return Reform() if look.saved else Hold()
    return Hold()


def leave_saves_first(look: SaveLook) -> bool:
    """A graceful leave of a member of a running round saves first when its workers can: they speak the
    protocol and still run. A request already on the round (a notice) is joined, not replaced."""
    return look.protocol and look.running
