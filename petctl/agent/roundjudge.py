"""The rules that judge a running round, as pure functions the round runner (roundrunner.py) acts on: what
`live/` and this node's workers say, and the planned changes that save first.

Sections: the judges of `live/` and of the workers; planned membership changes (admission, a leave).

What a running round's events mean, as pure functions: the round runner (roundrunner.py) acts on them.

Two judges, both tested by tables (tests/agent/test_round_decisions.py):
- `judge(view, info, settings)`: what `live/` says about the round (over, a member lost, a node
  waiting that can be admitted, every member done).
- `judge_workers(watch, workers, now, timing)`: what this node's workers say (succeeded, failed, stuck
  at exit), with the little the node remembers between two looks in `WorkerWatch`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from petctl.agent.decisions import EndJob, RoundInfo, Settings, StoreView
from petctl.core.records import Phase, Round, SaveNow

# --- judging a running round --------------------------------------------------------------------------------

class RoundOutcome(enum.Enum):
    """How one round ended for this node."""

    NEXT_ROUND = "next round"  # the round was replaced: rendezvous again (as the same member)
    JOB_ENDED = "job ended"  # the round went final
    LEAVE = "agent asked to leave"  # SIGTERM: leave gracefully
    PREEMPTED = "preemption checkpoint done"  # noticed: leave before the reclaim (see preempted_why)
    FENCED = "fenced"  # cut off from etcd while our workers stalled: they were stopped; rejoin


def preempted_why(protocol: bool, saved: int, nproc: int, timed_out: bool) -> str:
    """The words a PREEMPTED round ends with (`why` of `workers.stopped` and `round.summary`), true to
    what happened: "preemption checkpoint done" only when every local worker reported its save.

    `protocol`: the workers marked themselves `elastic.<rank>` (else a plain script: it got SIGTERM at
    the notice, and whatever it did with it, it reported no save); `saved`: local workers that wrote
    `saved.<rank>`; `timed_out`: the save deadline passed before they all did.
    """
    if saved >= nproc:
        return RoundOutcome.PREEMPTED.value
    if not protocol:
        return "preempted: workers stopped by SIGTERM, no save reported"
    how = "save timed out" if timed_out else "workers exited before saving"
    return f"preempted: {how}, {saved} of {nproc} local workers saved"


# --- what live/ says --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Continue:
    """Nothing to do: the round goes on."""


@dataclass(frozen=True)
class Over:
    outcome: RoundOutcome  # NEXT_ROUND or JOB_ENDED


@dataclass(frozen=True)
class MembershipChange:
    """Open the next round: a member is gone, or a waiting node can be admitted."""

    event: str  # membership.lost | membership.waiting
    nodes: tuple[str, ...]
    cause: str


@dataclass(frozen=True)
class Rebuild:
    """etcd answers but holds no round while we run one: it was replaced by an empty store on the same
    address (what replacing the etcd host does). Write our round back; the job carries on in it."""

    round: Round


Verdict = Continue | Over | MembershipChange | EndJob | Rebuild


def judge(view: StoreView, info: RoundInfo, s: Settings, finishing: bool = False) -> Verdict:
    """What the view means for the round `info` describes.

    A member whose heartbeat is gone is lost unless it is done (finished the round with every worker
    exiting 0): done nodes may exit. Waiting nodes are admitted below `max` by the lowest live rank only,
    so one node pays for the CAS, unless a live member is handing off its place after a spot notice
    (`Round.handoffs`): the waiting node is then that member's to admit, in its hand-off's one re-form.
    Every member done ends the job `succeeded`.
    Once the job's workers have finished (a member is done, or `finishing`: a worker of ours exited 0),
    no membership change re-forms the round: re-forming would only restart every worker to load the
    final step and exit (issue 25). A waiting node is not admitted, and a member lost from then on is
    not replaced: the job ends `succeeded` once every member is done or gone.
    While the view is not `settled` (etcd just failed, stalled or lost our own key: see
    agent/health.py), or our own heartbeat is missing from it (every key expired together),
    nobody is judged lost or admitted: absences then are the outage's expiries.
    A view with no round at all, while we run one, means the store was wiped: rebuild it.
    """
    rnd = view.round
    if rnd is not None and rnd.phase is Phase.FINAL:
        return Over(RoundOutcome.JOB_ENDED)
    if rnd is None and info.record is not None:
        return Rebuild(info.record)
    if rnd is None or rnd.round != info.round:
        return Over(RoundOutcome.NEXT_ROUND)
    done = view.done_in(info.round)
    all_done = done >= info.ranks.keys()
    if not view.settled or s.node_id not in view.alive:  # our own key gone too: the store's doing
        return EndJob("succeeded", finished(view, info.round), info.round) if all_done else Continue()
    lost = tuple(sorted(n for n in info.ranks if n not in view.alive and n not in done))
    if done or finishing:
        if done and not all_done and set(lost) | done >= info.ranks.keys():
            return EndJob("succeeded", finished(view, info.round, lost), info.round)
        return EndJob("succeeded", finished(view, info.round), info.round) if all_done else Continue()
    if lost:
        return MembershipChange("membership.lost", lost, f"node lost: {','.join(lost)}")
    waiting = tuple(sorted(view.alive - info.ranks.keys()))
    handing_off = bool(rnd.handoffs.keys() & view.alive & info.ranks.keys())  # theirs to admit: `handoff`
    if (waiting and not handing_off and len(info.ranks) < s.max_nodes
            and is_lowest_live_rank(info, view.alive)):
        return MembershipChange("membership.waiting", waiting, f"scale-up: {','.join(waiting)}")
    if all_done:
        return EndJob("succeeded", finished(view, info.round), info.round)
    return Continue()


def finished(view: StoreView, round_no: int, lost: tuple[str, ...] = ()) -> str:
    """The reason of a job that finished in `round_no`: clean, or a mixed ending (a node's workers failed
    after a rank had exited 0: docs/reliability.md), whose failures the reason names so a user sees them."""
    reason = "all workers exited 0"
    if mixed := view.mixed.get(round_no):
        failed = "; ".join(f"{node}: {failure}" for node, failure in sorted(mixed.items()))
        reason = f"finished: a rank exited 0, then workers failed after it (not restarted) ({failed})"
    return f"{reason} ({','.join(lost)} lost after the others finished)" if lost else reason


def is_lowest_live_rank(info: RoundInfo, alive: frozenset[str]) -> bool:
    live_ranks = [r for n, r in info.ranks.items() if n in alive]
    return bool(live_ranks) and info.rank == min(live_ranks)


# --- what the workers say ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Workers:
    """One look at the node's workers."""

    exited: bool  # all exited, or one failed (its peers are likely blocked in a collective)
    succeeded: bool  # ... and every one exited 0
    first_failure: tuple[int, int] | None  # (local rank, exit code)
    some_succeeded: bool  # at least one exited 0 (others may run)
    running: bool
    round_done_elsewhere: bool  # another member of the round is done
    saving_now: bool  # the round carries a save-now request: exits are neither success nor failure
    idle: float = 0.0  # seconds since the workers last showed progress (or started, if they never did)
    # Monotonic: when the last of the running workers said its script had finished (`worker.exiting`), if
    # every running one has; None otherwise. They are only exiting now (agent/warm_worker.py).
    exiting_since: float | None = None


@dataclass(frozen=True)
class WorkerWatch:
    """What this node remembers about its workers during one round."""

    failure: str = ""  # the first failure, described
    failed_at: float | None = None
    restart_asked: bool = False  # we asked for the next round once; the view will show it
    finishing_since: float | None = None
    finished: bool = False
    hung: bool = False  # the hang watchdog fired: the restart it asks for is counted as a failure


@dataclass(frozen=True)
class Timing:
    finish_grace: float  # once a rank exited 0, how long the others get to exit too
    fail_grace: float  # how long a failure waits for a vanished peer's heartbeat to expire
    hang: float | None = None  # running workers without progress this long are hung; None: no watchdog
    exit_grace: float = 10.0  # once every running worker's script finished, how long their exit may take


DEFAULT_HANG = 300.0  # the watchdog of a script that reports progress, unless --timeout hang=SECONDS


def hang_limit(timeout: float, reporting: bool, progressed: bool = True) -> float | None:
    """How long running workers may go without progress (a `train.step` line or another event of
    theirs) before their round is a hang; None: no watchdog.

    `timeout` is `--timeout hang=SECONDS` (0: not given). A script that reports progress gets the
    watchdog by default (DEFAULT_HANG); one that reports none only when asked, and then any line it
    prints counts as progress (the runner's `idle`), since nothing else shows that it lives. Until the
    round's first progress (`progressed` False) the limit is at least DEFAULT_HANG: start-up (imports,
    a warm worker still importing, loading a checkpoint) is not a stalled step, and a limit sized for
    steps would cut it short.
    """
    if timeout > 0:
        limit = timeout
    elif reporting:
        limit = DEFAULT_HANG
    else:
        return None
    return limit if progressed else max(limit, DEFAULT_HANG)


@dataclass(frozen=True)
class Idle:
    pass


@dataclass(frozen=True)
class StopLingering:
    """Ours still run though their work is over: stop them and count the node done. Either a rank exited 0
    finish_grace ago, or our scripts finished exit_grace ago and the interpreter's exit is stuck."""

    seconds: float  # how long they were given
    cause: str = "a rank of the job finished and ours still ran"


@dataclass(frozen=True)
class Succeeded:
    pass


@dataclass(frozen=True)
class ReportFailure:
    local_rank: int
    code: int


@dataclass(frozen=True)
class AskRestart:
    cause: str


@dataclass(frozen=True)
class ReportHang:
    """Every worker runs, none made progress for `seconds`: a fault (`workers.hung`), restarted like a
    failure next (AskRestart, counted against --max-restarts)."""

    seconds: float


@dataclass(frozen=True)
class FailedAfterFinish:
    """A mixed ending: our workers failed after a rank of the job had exited 0 (ours or another node's).
    The job's training is over: the node counts as done, the failure is reported, and nothing restarts,
    so the finished rank's work is not redone (docs/reliability.md, "Mixed endings")."""


WorkerStep = Idle | StopLingering | Succeeded | ReportFailure | AskRestart | ReportHang | FailedAfterFinish


def judge_workers(watch: WorkerWatch, w: Workers, now: float, t: Timing,
                  node_id: str) -> tuple[WorkerStep, WorkerWatch]:
    """The next step for this node's workers, and what to remember.

    All ranks of a data-parallel job end together: once one exited 0, a worker still running after
    finish_grace is stuck at exit (seen in destroy_process_group once its peers had gone), so it is
    stopped and the node counts as done rather than hang the job. A worker whose script said it finished
    (`exiting_since`) gets only exit_grace: all that is left is its interpreter's exit, which a gloo
    group's destructor can deadlock (agent/warm_worker.py, `finish_script`). A failure waits fail_grace
    before it asks for a restart: a peer that vanished makes our workers fail too, and its heartbeat expiring
    first makes that a membership change, not a failure. A failure once a rank has finished (exited 0
    here, or a member done) is a mixed ending: FailedAfterFinish, never a restart. Running workers idle
    past `t.hang` are hung: ReportHang, then AskRestart.
    """
    if watch.finished or w.saving_now:
        return Idle(), watch
    if watch.finishing_since is None and (w.some_succeeded or w.round_done_elsewhere):
        watch = dataclasses.replace(watch, finishing_since=now)
    if w.running and w.exiting_since is not None and now - w.exiting_since > t.exit_grace:
        return (StopLingering(t.exit_grace, "stuck at exit after the script finished"),
                dataclasses.replace(watch, finished=True))
    if watch.finishing_since is not None and now - watch.finishing_since > t.finish_grace and w.running:
        return StopLingering(t.finish_grace), dataclasses.replace(watch, finished=True)
    if watch.hung:
        if watch.restart_asked:
            return Idle(), watch
        return AskRestart(watch.failure), dataclasses.replace(watch, restart_asked=True)
    if not w.exited:
        if t.hang is not None and watch.finishing_since is None and w.idle > t.hang:
            cause = f"hang on {node_id}: workers alive, no progress for {w.idle:.0f}s"
            return ReportHang(w.idle), dataclasses.replace(watch, failure=cause, failed_at=now, hung=True)
        return Idle(), watch
    if w.succeeded:
        return Succeeded(), dataclasses.replace(watch, finished=True)
    if watch.failed_at is None:
        local_rank, code = w.first_failure or (0, -1)
        failure = f"worker failure on {node_id} (local rank {local_rank}, exit code {code})"
        return ReportFailure(local_rank, code), dataclasses.replace(watch, failure=failure, failed_at=now)
    if watch.finishing_since is not None and not watch.restart_asked:
        return FailedAfterFinish(), dataclasses.replace(watch, finished=True)
    if not watch.restart_asked and now - watch.failed_at > t.fail_grace:
        return AskRestart(watch.failure), dataclasses.replace(watch, restart_asked=True)
    return Idle(), watch


# --- planned changes save first -----------------------------------------------------------------------------
# Planned membership changes save first: pure decisions for the round runner (roundrunner.py).
#
# A membership change we choose (admitting a waiting node, a graceful leave such as `petctl scale` down or a
# SIGTERM of the agent) need not throw away the steps since the last periodic checkpoint. Before the old
# round's workers are stopped, the node that causes the change puts a save-now request on the round
# (`Round.save_now`, the same record a spot notice uses); every member flags its workers through
# `<control>/save_now`, the ranks agree on one step in the all-reduce `petctl.elastic` already runs, save it
# and exit 0. Only then does the round re-form, and everyone resumes from that step: nothing is redone.
#
# Unplanned changes (a node lost, a worker failure) cannot save first: a lost peer blocks every collective.
# Scripts that do not speak the protocol (no `elastic.<rank>` marker: plain torchrun scripts) keep today's
# behaviour: their workers get SIGTERM, as torchrun sends.

@dataclass(frozen=True)
class SaveLook:
    """What the node sees when it wants a planned change."""

    node_id: str
    request: SaveNow | None  # the round's save-now request, if any
    protocol: bool  # every local worker speaks the save-now protocol (petctl.elastic)
    running: bool  # our workers still run (nothing to save once they exited)
    saved: bool  # our workers reported the requested save, exited, or its deadline passed
    finished: bool = False  # a worker of ours exited 0 outside a save: the job's training is over


@dataclass(frozen=True)
class RequestSave:
    """CAS this request onto the round; the workers save, then the round re-forms."""

    request: SaveNow


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
    with no save asked, even with a request on the round that came too late for them) are never
    re-formed for a waiting node: hold, and the job ends.
    """
    if look.finished:  # finished workers: re-forming would only restart them
        return Hold()
    request = look.request
    if request is None:
        if cause is None:
            return Hold()
        if look.protocol and look.running:
            return RequestSave(SaveNow(node_id=look.node_id, deadline=wall + budget, reason=cause,
                                       leaves=False))
        return Reform()
    if request.node_id == look.node_id and not request.leaves:
        return Reform() if look.saved else Hold()
    return Hold()


def leave_saves_first(look: SaveLook) -> bool:
    """A graceful leave of a member of a running round saves first when its workers can: they speak the
    protocol and still run. A request already on the round (a notice) is joined, not replaced."""
    return look.protocol and look.running


# --- a spot notice's hand-off -------------------------------------------------------------------------------
# A spot notice gives two minutes. The noticed node uses them (agent/notices.py does the I/O):
# - at the notice its instance leaves its group without lowering the group's desired capacity, so the
#   replacement is launched at once (AWS's DetachInstances; the local provider's reconciler likewise);
# - the node puts itself on the round's `handoffs` and trains on, so the job keeps its full world size;
# - it hands off at whichever comes first: a node waits to join (the replacement is up: the round it
#   re-forms admits it in the leaver's place, one re-form, no round at N-1), or the last moment that
#   still leaves time for a save (`handoff_at`, from the node's measured saves; with none measured yet,
#   at once): then the job trains at N-1 until the replacement joins;
# - handing off is the save-now request every notice makes: every rank saves the same step, the node
#   leaves, and its instance ends itself, so the rest of the window is not billed.
# A scale-in notice ("asg") and a graceful leave hand off at once: nothing replaces them.

SPOT = "spot"
# The time kept for the hand-off's save: twice the longest recent save (a periodic save may still be in
# flight when the hand-off comes, and the hand-off's own waits for it), plus a second.
SAVE_SAFETY = 2.0
SAVE_SLACK = 1.0


@dataclass(frozen=True)
class HandoffLook:
    """What a noticed node weighs before it hands off (`handoff`)."""

    kind: str  # the notice's kind: spot | asg | leave
    now: float  # epoch seconds
    handoff_at: float  # the last moment to ask for the save (`handoff_at`)
    waiting: bool  # a live node outside the round waits to join: the replacement, or any joiner
    marked: bool  # our hand-off is on the round (`Round.handoffs`)


@dataclass(frozen=True)
class MarkHandoff:
    """Put our hand-off on the round (CAS), so no one else admits the waiting node; keep training."""


@dataclass(frozen=True)
class HandOff:
    """Ask for the save now: every rank saves the same step, then we leave (`why`: for the event)."""

    why: str  # replacement | deadline | notice


@dataclass(frozen=True)
class TrainOn:
    """Nothing to do yet: the job trains at full size."""


HandoffStep = MarkHandoff | HandOff | TrainOn


def handoff(look: HandoffLook) -> HandoffStep:
    """The noticed node's next step. Only a spot notice trains on; the others hand off at once."""
    if look.kind != SPOT:
        return HandOff("notice")
    if look.waiting:
        return HandOff("replacement")
    if look.now >= look.handoff_at:
        return HandOff("deadline")
    return TrainOn() if look.marked else MarkHandoff()


def save_estimate(measured: list[float], budget: float) -> float:
    """Seconds to keep for the hand-off's save: the longest recent save of this node, with a margin
    (`SAVE_SAFETY`, `SAVE_SLACK`). Before any save was measured nothing says the window is long enough,
    so the whole `budget` is kept: the node hands off at once, as a notice too short for a save does."""
    if not measured:
        return budget
    return max(measured) * SAVE_SAFETY + SAVE_SLACK


def handoff_at(save_deadline: float, save_s: float, step_s: float) -> float:
    """The last moment to ask for the save: the workers finish the step under way (`step_s`), then save
    (`save_s`), all before `save_deadline`."""
    return save_deadline - save_s - step_s
