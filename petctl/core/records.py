"""The wire format: every record petctl writes to etcd or the object store, as a typed dataclass.

Why typed: agents of different ages share one etcd during a rolling upgrade, the CLI reads what agents
wrote, and the docs describe the same fields; one definition keeps the three in step
(tests/core/test_records.py checks docs/ARCHITECTURE.md's field lists against these classes).

Rules every record follows:
- `to_json()` writes every field, `from_json()` reads it back equal (a round trip is the identity).
- Unknown keys are ignored and missing optional keys take their defaults, so an older reader accepts a
  newer writer's record and the other way round.
- A value that is not a JSON object, or lacks a required field, raises `WireFormatError` (a
  `ValueError`): callers decide whether a corrupt record is skipped (and counted) or fatal.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="WireRecord")


class WireFormatError(ValueError):
    """A stored value is not a valid record of the expected kind."""


class Phase(str, enum.Enum):
    """`live/round`'s phase: the round's place in its life."""

    JOINING = "joining"  # nodes write join records; the closer freezes it
    FROZEN = "frozen"  # the barrier is passed: ranks are fixed, workers run
    FINAL = "final"  # the job is over; `result` says why


class WireRecord:
    """JSON codec shared by the records below (dataclasses of JSON-native fields)."""

    # Fields holding nested records: name -> record class (decoded from their dicts).
    _nested: ClassVar[dict[str, type[WireRecord]]] = {}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, WireRecord):
                value = value.to_dict()
            elif isinstance(value, enum.Enum):
                value = value.value
            out[f.name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls: type[R], data: Any) -> R:
        """Build the record from a decoded JSON object. Raises WireFormatError."""
        if not isinstance(data, dict):
            raise WireFormatError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise WireFormatError(f"{cls.__name__}: missing field {f.name!r}")
                continue
            value = data[f.name]
            nested = cls._nested.get(f.name)
            if nested is not None and value is not None:
                value = nested.from_dict(value)
            kwargs[f.name] = value
        try:
            record = cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise WireFormatError(f"{cls.__name__}: {e}") from e
        return record

    @classmethod
    def from_json(cls: type[R], text: str | bytes | None) -> R:
        """Parse a stored value. Raises WireFormatError (empty, not JSON, or not this record)."""
        if not text:
            raise WireFormatError(f"{cls.__name__}: empty value")
        try:
            data = json.loads(text)
        except ValueError as e:
            raise WireFormatError(f"{cls.__name__}: not JSON ({e})") from e
        return cls.from_dict(data)


@dataclass(frozen=True)
class SaveNow(WireRecord):
    """A save-now request carried on the running round (`Round.save_now`), so every member's workers save
    the same step and exit before the round re-forms: an instance's spot or ASG notice (a preemption), a
    graceful leave, or a planned admission of a waiting node (agent/roundjudge.py). `reason` says which."""

    node_id: str  # the node that asked
    deadline: float  # epoch seconds: the save must be done by then (a noticed instance is taken)
    reason: str = "preemption"  # preemption | leave | scale-up: ... (for events and docs)
    leaves: bool = True  # the asking node leaves after the save; False: nobody leaves (an admission)


@dataclass(frozen=True)
class Round(WireRecord):
    """`live/round`: the one value every agent watches, changed only by compare-and-swap."""

    _nested: ClassVar[dict[str, type[WireRecord]]] = {"save_now": SaveNow}

    round: int | None  # None only on a `final` record written before any round opened
    phase: Phase
    ts: float  # when this round was opened (recovery time is measured from it)
    restarts: int = 0  # worker failures so far (max_restarts bounds it)
    cause: str = ""  # why this round was opened
    save_now: SaveNow | None = None  # a save-now request every member's workers act on
    # Members under a spot notice that train on until they hand their place over (agent/roundjudge.py,
    # `handoff`): node_id -> when its instance is reclaimed. While one is alive, a waiting node is theirs
    # to admit, in the one re-form of their hand-off, not the lowest rank's.
    handoffs: dict[str, float] = field(default_factory=dict)
    # The ranks of the round this one replaced, less a node that opened it to leave: its members that are
    # still alive are expected to join this one (the closer waits for them; see agent/decisions.py).
    prev_ranks: dict[str, int] = field(default_factory=dict)
    # Set when frozen:
    ranks: dict[str, int] = field(default_factory=dict)  # node_id -> node rank
    world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    frozen_ts: float | None = None
    # Set when final:
    state: str = ""  # succeeded | failed | killed
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))
        object.__setattr__(self, "ranks", {str(k): int(v) for k, v in (self.ranks or {}).items()})
        object.__setattr__(self, "prev_ranks",
                           {str(k): int(v) for k, v in (self.prev_ranks or {}).items()})
        object.__setattr__(self, "handoffs",
                           {str(k): float(v) for k, v in (self.handoffs or {}).items()})


@dataclass(frozen=True)
class JoinRecord(WireRecord):
    """`rounds/<n>/<node_id>`: a node's entry into round n, with the address rank 0 would serve on."""

    node_id: str
    addr: str
    port: int
    ts: float
    prev_rank: int | None = None  # the node's rank in the round before (it keeps it if it can)


@dataclass(frozen=True)
class NodeRecord(WireRecord):
    """`live/nodes/<node_id>`: the heartbeat (TTL'd); its presence is what "alive" means."""

    node_id: str
    host_addr: str
    pid: int


@dataclass(frozen=True)
class DoneRecord(WireRecord):
    """`live/done/<n>/<node_id>`: the node finished round n: every worker exited 0, or (a mixed ending,
    docs/reliability.md) its workers failed after a rank of the job had exited 0; `failure` says how."""

    ts: float
    failure: str = ""  # "" for a clean finish; the failure of a mixed ending, which ends the job's reason


@dataclass(frozen=True)
class Checkpoint(WireRecord):
    """A node's newest saved checkpoint, as its workers reported it (`NodeStatus.last_checkpoint`)."""

    step: int | None
    url: str | None = None
    interval_s: float | None = None  # every="auto": the durable interval chosen (checkpoint.interval)
    interval_reason: str = ""
    save_s: float | None = None  # how long this save took (rank 0's write): what a noticed node plans with


@dataclass(frozen=True)
class NodeStatus(WireRecord):
    """`status/<node_id>` (TTL'd) and the mirror's status file: what `petctl status` shows per node."""

    _nested: ClassVar[dict[str, type[WireRecord]]] = {"last_checkpoint": Checkpoint}

    node_id: str
    state: str  # starting | joining | waiting | running | stopping | leaving | succeeded | failed | ...
    updated: float
    host_addr: str = ""
    pid: int | None = None
    round: int | None = None
    rank: int | None = None
    world_size: int | None = None
    restarts: int | None = None
    step: int | None = None
    last_checkpoint: Checkpoint | None = None
    etcd_requests: dict[str, int] = field(default_factory=dict)  # reads/writes/watches so far
    failures: dict[str, int] = field(default_factory=dict)  # service -> failed attempts so far
    # The last lines (bounded) a failed worker of this node printed that were not events: why it failed.
    last_error: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class JobResult(WireRecord):
    """`result` in etcd and `result.json` beside the job's data: how the job ended. Written once."""

    state: str  # succeeded | failed | killed
    reason: str
    ts: float
    round: int | None = None
    job: str = ""
    node: str = ""  # the agent that wrote it ("" when a provider did: kill_job, the local reconciler)


@dataclass(frozen=True)
class BootRecord(WireRecord):
    """`boots/<ts>.<instance_id>.<event>.json` in the job's prefix (AWS): one step of one instance's boot.

    Written by the boot script in bash (`started`, `installing`, `failed`: worker_image/boot_record.sh.j2)
    and by the agent once it is registered in the rendezvous (`joined`). The key repeats the event and
    its time, so the boot breaker (petctl/core/boots.py) decides from one listing; the body adds what a
    failure said (`error`, the boot log's last lines) for `petctl status`."""

    instance_id: str
    event: str  # started | installing | joined | failed
    ts: float  # epoch seconds on the writer's clock
    error: str = ""  # failed: what `fatal` said
    log_tail: list[str] = field(default_factory=list)  # failed: the boot log's last lines
