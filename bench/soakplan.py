"""The soak's history of faults, drawn from a seed: a pure function, so the same seed replays the same
history (the same kinds, in the same order, at the same offsets, aimed at the same ranks).

What a seed fixes is the plan, not the machine: which node holds the rank a fault aims at, and how long
a recovery takes, come from the running job. bench/soak.py carries each planned fault out and records
what happened; bench/soakoracle.py judges it.

Kinds (`KINDS`), each with what it means on the local provider:
- kill: SIGKILL an instance (a host that vanished);
- freeze: SIGSTOP an instance, SIGCONT it `hold` seconds later (a host that hangs, then comes back);
- term: SIGTERM an agent (a graceful leave);
- notice: a spot notice, reclaimed after `grace`;
- rebalance: a rebalance recommendation (then a replacement and a scale-in notice);
- worker_crash: SIGKILL one worker process of a node (not its agent);
- scale_up, scale_down: `petctl scale` by one node;
- burst: three `petctl scale` calls within a second or two, ending one node off where it started;
- etcd_stall: SIGSTOP the etcd server, SIGCONT it `hold` seconds later;
- etcd_down: SIGKILL the etcd server, start it again on the same address with its data `hold` s later;
- joiner_lost: scale up by one, then kill the new node as soon as it registers (while the others save
  first for it);
- notice_in_reform: kill one node, then a spot notice to another `hold` seconds (< 1) later, so the
  notice lands while the survivors re-form.

Kinds the local provider cannot inject (a partition needs root and network namespaces; a wiped etcd
loses the job's etcd user, which only `run_job` makes; one etcd member of three needs
`--etcd-nodes 3`, an AWS setup; a slow object store needs an S3 endpoint) are in `NOT_LOCAL` with why.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

KINDS = ("kill", "freeze", "term", "notice", "rebalance", "worker_crash", "scale_up", "scale_down", "burst",
         "etcd_stall", "etcd_down", "joiner_lost", "notice_in_reform")

# The default mix: weights, not probabilities (`--rate KIND=W` changes one; 0 leaves a kind out).
DEFAULT_RATES = {"kill": 3.0, "freeze": 2.0, "term": 1.0, "notice": 2.0, "rebalance": 1.0,
                 "worker_crash": 2.0, "scale_up": 1.5, "scale_down": 1.5, "burst": 1.0, "etcd_stall": 1.5,
                 "etcd_down": 1.0, "joiner_lost": 1.0, "notice_in_reform": 1.0}

NOT_LOCAL = {
    "partition": "needs root and a network namespace per node (tests/e2e/test_partition_local.py runs one "
                 "partition that way); the soak runs unprivileged",
    "etcd_wipe": "the local etcd keeps the job's etcd user in its data: an empty etcd has no user for "
                 "the agents, and only run_job makes one (tests/e2e/test_store_faults.py wipes an etcd "
                 "without auth)",
    "etcd_member_lost": "the local provider runs one etcd; three members are an AWS setup "
                        "(tests/e2e/test_etcd_cluster_member_lost.py loses the member in use)",
    "slow_store": "the local job checkpoints to file://; a throttled or failing S3 during a save is "
                  "tests/e2e/test_notice_during_upload.py's",
}

OVERLAP_WINDOW = 5.0  # an overlapping fault lands within this many seconds of the previous one


@dataclass(frozen=True)
class PlannedFault:
    """One fault of the history. `after`: seconds after the previous fault's injection (an overlap), or
    None: once every fault so far has recovered, then `settle` more seconds. `pick`: which of the live
    ranks it aims at (an index into them, taken modulo their count at injection). `hold`: seconds the
    fault lasts, where it has a length (freeze, etcd_stall, etcd_down, notice_in_reform's gap). `grace`:
    a notice's window."""

    index: int
    kind: str
    after: float | None
    settle: float
    pick: int
    hold: float
    grace: float

    def to_dict(self) -> dict:
        return asdict(self)


def parse_rates(items: list[str]) -> dict[str, float]:
    """`KIND=WEIGHT` items over the defaults. Raises ValueError for an unknown kind or a bad weight."""
    rates = dict(DEFAULT_RATES)
    for item in items:
        kind, sep, value = item.partition("=")
        if not sep or kind not in KINDS:
            raise ValueError(f"--rate {item!r}: expected KIND=WEIGHT with KIND one of {', '.join(KINDS)}")
        weight = float(value)
        if weight < 0:
            raise ValueError(f"--rate {item!r}: a weight is >= 0")
        rates[kind] = weight
    if not any(rates.values()):
        raise ValueError("every --rate is 0: no fault to draw")
    return rates


def plan(faults: int, seed: int, rates: dict[str, float] | None = None, overlap: float = 0.5,
         grace: tuple[float, float] = (4.0, 10.0)) -> list[PlannedFault]:
    """`faults` faults drawn from `seed`: kinds by `rates`, each landing within OVERLAP_WINDOW s of the
    previous one with probability `overlap`, else after every earlier one recovered. Pure: the same
    arguments give the same list. Raises ValueError for a negative count or an overlap outside [0, 1]."""
    if faults < 0 or not 0.0 <= overlap <= 1.0:
        raise ValueError(f"faults={faults}, overlap={overlap}: need faults >= 0 and 0 <= overlap <= 1")
    weights = rates or DEFAULT_RATES
    kinds = [k for k in KINDS if weights.get(k, 0.0) > 0]
    rng = random.Random(seed)
    out = []
    for i in range(faults):
        kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        lands_close = i > 0 and rng.random() < overlap
        after = round(rng.uniform(0.0, OVERLAP_WINDOW), 2) if lands_close else None
        hold = {"freeze": rng.uniform(1.0, 6.0), "etcd_stall": rng.uniform(2.0, 8.0),
                "etcd_down": rng.uniform(2.0, 8.0), "notice_in_reform": rng.uniform(0.0, 1.0)}.get(kind, 0.0)
        out.append(PlannedFault(index=i, kind=kind, after=after, settle=round(rng.uniform(0.0, 2.0), 2),
                                pick=rng.randrange(1 << 16), hold=round(hold, 2),
                                grace=round(rng.uniform(*grace), 2)))
    return out
