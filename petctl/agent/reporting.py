"""What a node reports and where: its state, events and log mirrored to the job's prefix (`Mirror`), its
events into etcd (`EtcdEventSink`), its `NodeStatus` (`StatusPublisher`) and the workers' progress it follows
(`Progress`).

Sections: the mirror (this docstring); the etcd event sink; the node status.

Where the agent's state, events and log go besides etcd, so they can be read without etcd.

On AWS etcd lives inside the VPC (no port open to the world), and a job's record must outlive the job;
so each agent mirrors to the job's prefix (s3://bucket/jobs/<job>/ or file://...):

    result.json                       the job's final result, written once by the agent that ended it
    status/<node_id>.json             the node state published in etcd (uploaded when it changed)
    events/<node_id>/<chunk>.jsonl    the events this agent emitted, as append-only chunks
    logs/<node_id>/<chunk>.log        the node log (agent events + worker output), as append-only chunks

Chunks (petctl/core/mirrorchunks.py) hold only what is new since the previous upload, so the bytes sent per
interval follow the new lines, not the file's size, and a versioned bucket keeps no stale copies. The
log's uploaded offset is kept next to the log (`.<log name>.mirrored`), so an agent restarted on the same
node continues where its predecessor stopped instead of sending the whole file again.

Uploads run on one background thread every `interval` seconds and once more at exit; every write (the
final result's too) goes through `flush`, one at a time, so no two threads ever write the same object or
offset file. A failing upload is retried next time (nothing is dropped until it is stored, the result
included) and never disturbs training. Failures are counted (`failures`, published in the node status)
and reported as events, once when an outage starts (`mirror.outage`) and once when it ends
(`mirror.recovered`), so an agent without access to its prefix is visible instead of silently
mirroring nothing. The bytes go through `petctl.io.objstore` (boto3 loads for s3:// only); no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.agent.decisions import RoundInfo
from petctl.agent.health import OutageReporter
from petctl.agent.leases import LeaseClasses
from petctl.agent.rendezvous import RequestStats
from petctl.core.keys import JobKeys
from petctl.core.mirrorchunks import chunk_name
from petctl.core.records import Checkpoint, JobResult, NodeStatus
from petctl.io.eventlog import EventLog
from petctl.io.files import atomic_write
from petctl.io.objstore import ObjectNotFound, ObjectStore, open_object_store
from petctl.io.store import store_errors
from petctl.io.threads import Service

# --- mirror -------------------------------------------------------------------------------------------------

MAX_CHUNK_BYTES = 8 * 1024 * 1024  # one PUT at most; a larger backlog goes as several chunks
MAX_PENDING_EVENTS = 20000  # events kept for upload while the store is unreachable (oldest dropped)


class Mirror:
    """Mirrors one node's status, events and log under `url` (see the module docstring).

    log: where the outage events go; the agent passes its own EventLog (which forwards them to etcd and,
        through `add_event`, to this mirror). By default a log of its own on stderr that also feeds
        this mirror, so the outage is on record once uploads work again.
    store: the object store to write to (tests); default `open_object_store(url)`.
    """

    def __init__(self, url: str, node_id: str, log_path: Path | None, interval: float = 10.0,
                 log: EventLog | None = None, store: ObjectStore | None = None) -> None:
        self.store = store if store is not None else open_object_store(url)
        self.url = url
        self.node_id = node_id
        self.log_path = log_path
        self.interval = interval
        if log is None:
            log = EventLog("mirror", node_id=node_id)
            log.add_sink(self.add_event)
        self.log = log
        self.epoch_ms = int(time.time() * 1000)  # names this process's chunks apart from a predecessor's
        self._event_seq = 0
        self._log_seq = 0
        self._pending: list[dict[str, Any]] = []
        self._appended = 0  # events ever added; _pending holds the last len(_pending) of them
        self._status: dict[str, Any] | None = None
        self._status_sent: dict[str, Any] | None = None
        self._result: dict[str, Any] | None = None  # the job's result until it is stored
        self._lock = threading.Lock()  # the pending data above, shared with add_event/set_status
        self._flush_lock = threading.Lock()  # one flush at a time: the only path that writes
        self._service = Service("mirror", self._run)
        self._stop = self._service.stopping
        self.failures = 0  # failed flushes since start (published in the node status)
        self.dropped_events = 0  # events dropped over MAX_PENDING_EVENTS, not yet reported
        self._outage_failures = 0  # consecutive failed flushes (0: no outage)
        self._outage_since = 0.0

    def start(self) -> None:
        self._service.start()

    def add_event(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(record)
            self._appended += 1
            excess = len(self._pending) - MAX_PENDING_EVENTS
            if excess > 0:
                del self._pending[:excess]
                self.dropped_events += excess

    def set_status(self, value: dict[str, Any]) -> None:
        with self._lock:
            self._status = dict(value)

    def put_result(self, value: dict[str, Any]) -> bool:
        """The job's final result, next to its data (`result.json`): readable after the stack is gone.
        Written now if the store answers, else by a later flush; True when it is stored."""
        with self._lock:
            self._result = dict(value)
        return self.flush() and self._result is None

    def read_result(self) -> JobResult | None:
        """The job's result as stored in its prefix (by whichever agent ended it), or None if it has
        none. Raises OSError when the store cannot be read, WireFormatError when the record is not one."""
        try:
            data = self.store.get_bytes("result.json")
        except ObjectNotFound:
            return None
        return JobResult.from_json(data)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - a bug in one flush must not end mirroring for the rest of the job; counted and reported as an outage
                with self._flush_lock:
                    self._failed(exc)

    def flush(self) -> bool:
        """Upload what changed: the result, the status if it differs from the last one sent, the new
        events, the new log bytes. Each part advances only once stored, so a failure resends exactly
        what is missing. Returns whether everything is stored; a failure (an OSError from the store or
        the log file) is counted and reported, never raised."""
        with self._flush_lock:
            try:
                self._flush_result()
                self._flush_status()
                self._flush_events()
                self._flush_log()
                if self._succeeded():
                    self._flush_events()  # the report of the recovery itself, while the store answers
            except OSError as exc:  # network, credentials, throttling, a full disk: retried next time
                self._failed(exc)
                return False
        return True

    def _failed(self, exc: BaseException) -> None:
        """Count a failed flush; the first of an outage is reported (caller holds the flush lock)."""
        self.failures += 1
        self._outage_failures += 1
        if self._outage_failures == 1:
            self._outage_since = time.monotonic()
            self.log.emit("mirror.outage", url=self.url, error=f"{type(exc).__name__}: {exc}"[:500],
                          retry_every=self.interval)

    def _succeeded(self) -> bool:
        """A flush stored everything: report the end of an outage, and events dropped during it (caller
        holds the flush lock). True when it reported something."""
        reported = False
        if self._outage_failures:
            self.log.emit("mirror.recovered", url=self.url, failed_attempts=self._outage_failures,
                          seconds=round(time.monotonic() - self._outage_since, 3))
            self._outage_failures = 0
            reported = True
        if self.dropped_events:
            dropped, self.dropped_events = self.dropped_events, 0
            self.log.emit("mirror.events_dropped", url=self.url, count=dropped)
            reported = True
        return reported

    def _flush_result(self) -> None:
        with self._lock:
            result = self._result
        if result is not None:
            self.store.put_bytes("result.json", json.dumps(result, default=str).encode(), "application/json")
            with self._lock:
                if self._result is result:
                    self._result = None

    def _flush_status(self) -> None:
        with self._lock:
            status = self._status
        if status is not None and status != self._status_sent:
            self.store.put_bytes(f"status/{self.node_id}.json", json.dumps(status, default=str).encode(),
                                 "application/json")
            self._status_sent = status

    def _flush_events(self) -> None:
        with self._lock:
            batch = list(self._pending)
            end = self._appended  # index after the last event in this batch
        if not batch:
            return
        body = "".join(json.dumps(e, default=str) + "\n" for e in batch).encode()
        self.store.put_bytes(chunk_name("events", self.node_id, self.epoch_ms, self._event_seq), body,
                             "application/x-ndjson")
        self._event_seq += 1
        with self._lock:
            # add_event only appends (or drops the oldest over the cap): drop what is now stored
            first = self._appended - len(self._pending)
            del self._pending[:max(0, end - first)]

    def _flush_log(self) -> None:
        if self.log_path is None or not self.log_path.exists():
            return
        marker = self.log_path.with_name(f".{self.log_path.name}.mirrored")
        offset = _read_offset(marker)
        size = self.log_path.stat().st_size
        if offset > size:  # the log was truncated or replaced: start again from its beginning
            offset = 0
        while offset < size:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                data = f.read(min(MAX_CHUNK_BYTES, size - offset))
            if not data:
                break
            key = chunk_name("logs", self.node_id, self.epoch_ms, self._log_seq)
            self.store.put_bytes(key, data, "text/plain")
            self._log_seq += 1
            offset += len(data)
            atomic_write(marker, str(offset))

    def stop(self) -> None:
        if not self._service.stop(timeout=self.interval + 5):
            self.log.emit("mirror.lingered")  # the final flush below still runs, under its lock
        self.flush()


def _read_offset(marker: Path) -> int:
    try:
        return max(0, int(marker.read_text().strip() or 0))
    except (OSError, ValueError):
        return 0


# --- event sink ---------------------------------------------------------------------------------------------
# Ship the agent's events into etcd (`events/`, one key per event: `JobKeys.event`, its write time then the
# node, so key order is time order), off the agent's critical path.
#
# `petctl events` reads the job's timeline from here while the job runs (and from the S3/file mirror after
# etcd forgets it). Writes go through one background thread so an event emitted during a restart costs
# the restart nothing; keys live under a lease of EVENT_TTL (leases.py) so a long-finished job does not
# fill etcd. An event that cannot be
# written is dropped (the mirror still has it) and counted; an outage is reported once when it starts and
# once when it ends (health.py).

EVENT_TTL = 7 * 24 * 3600


class EtcdEventSink:
    def __init__(self, leases: LeaseClasses, keys: JobKeys, node_id: str, outage: OutageReporter,
                 ttl: int = EVENT_TTL) -> None:
        self.leases = leases
        self.keys = keys
        self.node_id = node_id
        self.ttl = ttl
        self._last_ns = 0  # keys strictly increase per node, even when the clock does not
        self.outage = outage
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=10000)
        self._thread = threading.Thread(target=self._run, name="event-sink", daemon=True)
        self.dropped = 0  # events never written: a failed write, or a full queue

    def start(self) -> None:
        self._thread.start()

    def __call__(self, record: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            self._last_ns = max(self._last_ns + 1, time.time_ns())
            try:
                self.leases.put(self.keys.event(self.node_id, self._last_ns), json.dumps(record, default=str),
                                self.ttl, new=True)
            except Exception as e:  # noqa: BLE001 - counted and reported; the sink thread must outlive it
                self.dropped += 1
                self.outage.failed(e)
            else:
                self.outage.succeeded()

    def stop(self, timeout: float = 5.0) -> None:
        """Drain what is queued (bounded by `timeout`), then stop."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the thread is stuck on a dead etcd with a full queue; it is a daemon
        self._thread.join(timeout=timeout)


# --- node status --------------------------------------------------------------------------------------------
# What a node tells the world about itself: its `NodeStatus`, in etcd and in the mirror.
#
# `petctl status` shows it per node: state, round, rank, the newest step and checkpoint, the etcd requests
# the agent made, the failures its services counted, and the last failed worker's error lines. It is
# informational: a failed publication is counted and reported once per outage (health.py), never allowed
# to stop training.
#
# Every put of the key is a raft proposal (an fsync on every member), so a node at rest must not put it on
# a timer (issue 47: two proposals per node per 10 s, 200 a second at 1000 nodes). `status_due` decides:
# - a change of what the node *is* (state, round, rank, world size, restarts, failures, last error) is put
#   at once, and so is its first measured save time and one SAVE_GROWTH times longer than the one put: a
#   noticed node of another rank plans its hand-off with rank 0's (notices.py, `writer_save`), and
#   without one it hands off at once instead of training on;
# - progress alone (step, last checkpoint, the request counters) is put on a backoff that starts at
#   PROGRESS_FIRST when the node's state last changed and doubles up to PROGRESS_MAX, so a new round's
#   first steps show within seconds and a steady round costs one put per PROGRESS_MAX;
# - nothing changed at all: put every REFRESH, so the key (under a lease of STATUS_TTL) never expires
#   under a live node.
# `updated` is the time of the put, so a reader can say how old a step is (cli/status.py shows it). The
# mirror gets every publication (it uploads only what changed, every `Mirror.interval`): its copy of the
# step is at most that old.

STATUS_TTL = 900  # the key lives 900-1800 s past its latest put (leases.py): longer than REFRESH
REFRESH = 600.0  # an unchanged status is put again this often
PROGRESS_FIRST = 5.0  # the first progress-only put of a state comes this long after it
PROGRESS_MAX = 300.0  # ... and the gap doubles up to this
SAVE_GROWTH = 1.5  # a save this many times longer than the one last put is put at once
FORWARDED = ("checkpoint.saved", "checkpoint.loaded", "train.resumed", "checkpoint.interval")


def changed_substance(old: NodeStatus | None, new: NodeStatus) -> bool:
    """Whether `new` says something other than progress since `old` (None: never put): what the node is,
    or a save time a hand-off should plan with (see the section's comment)."""
    if old is None:
        return True
    return _substance(old) != _substance(new) or _save_news(_save_s(old), _save_s(new))


def _save_s(status: NodeStatus) -> float | None:
    save = status.last_checkpoint.save_s if status.last_checkpoint is not None else None
    return float(save) if isinstance(save, int | float) else None


def _save_news(put: float | None, now: float | None) -> bool:
    return now is not None and (put is None or now > SAVE_GROWTH * put)


def _substance(status: NodeStatus) -> NodeStatus:
    return dataclasses.replace(status, updated=0.0, step=None, last_checkpoint=None, etcd_requests={})


def status_due(put: NodeStatus | None, current: NodeStatus, since_put: float, gap: float) -> str | None:
    """Why `current` should be put now, or None: "change" (what the node is changed since `put`, the
    status last put), "progress" (only progress changed, and `gap` seconds have passed since that put),
    "refresh" (nothing changed in REFRESH seconds). Pure: `since_put` and `gap` are the caller's clock."""
    if changed_substance(put, current):
        return "change"
    assert put is not None  # changed_substance is True for None
    moved = (put.step, put.last_checkpoint, put.etcd_requests) != (current.step, current.last_checkpoint,
                                                                   current.etcd_requests)
    if moved and since_put >= gap:
        return "progress"
    return "refresh" if since_put >= REFRESH else None


def next_gap(gap: float, why: str) -> float:
    """The progress backoff after a put made for `why` (status_due): back to PROGRESS_FIRST after a
    change, doubled (up to PROGRESS_MAX) after a progress put, unchanged after a refresh."""
    if why == "change":
        return PROGRESS_FIRST
    if why == "progress":
        return min(PROGRESS_MAX, 2 * gap)
    return gap


class Progress:
    """Follows the workers' progress lines (local rank 0 speaks for the node); no torch needed."""

    def __init__(self, nproc: int, events: EventLog) -> None:
        self.nproc = nproc
        self.events = events
        self.step: int | None = None
        self.round: int | None = None  # the round whose workers speak now: stamped on what they forward
        self.last_checkpoint: Checkpoint | None = None
        self.round_step_seen = False  # a step was logged in the current round
        self.span: dict[str, Any] = {}  # first/last step of the current round (goodput)
        self.last_step_at: float | None = None  # monotonic: the round's latest step (health.py)
        self.longest_gap = 0.0  # the round's longest time between two steps
        self.progress_at: float | None = None  # monotonic: the round's latest event of any worker
        self.reporting = False  # the workers ever reported progress (events): the hang watchdog's default
        # What a spot notice's hand-off plans with (roundjudge.handoff_at), kept across rounds: the
        # latest saves' durations and steps' gaps, in seconds.
        self.save_seconds: deque[float] = deque(maxlen=5)
        self.step_gaps: deque[float] = deque(maxlen=20)
        # The workers' output thread appends to both; the round runner and the notice's backstop thread
        # (agent/notices.py) read them: `plan_times` copies them under this lock.
        self._plan_lock = threading.Lock()

    def begin_round(self, round_no: int | None = None) -> None:
        """A new round's workers start: its span starts empty, and what they forward carries `round_no`
        (a round whose every member dies writes no `round.summary`; its workers' loads and saves still
        say where it started and how far it got, jobview/accounting.py)."""
        self.round = round_no
        self.span = {}
        self.round_step_seen = False
        self.last_step_at = None
        self.longest_gap = 0.0
        self.progress_at = None

    def step_time(self) -> float:
        """The median of the latest gaps between two steps (0.0 before two steps were seen)."""
        with self._plan_lock:
            gaps = tuple(self.step_gaps)
        if not gaps:
            return 0.0
        # a median by hand: statistics would load fractions and decimal into every agent at start
        ordered, mid = sorted(gaps), len(gaps) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    def plan_times(self) -> tuple[tuple[float, ...], float]:
        """(the latest saves' durations, the step time): what a notice's hand-off plans with, safe to call
        from any thread."""
        with self._plan_lock:
            saves = tuple(self.save_seconds)
        return saves, self.step_time()

    def stalled_for(self, now: float) -> float | None:
        """Seconds since the round's latest step; None when the workers reported none this round."""
        return None if self.last_step_at is None else now - self.last_step_at

    def on_worker_event(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        self.progress_at, self.reporting = time.monotonic(), True  # any worker's event is progress
        if int(record.get("local_rank", record.get("rank", 0)) or 0) % self.nproc != 0:
            return
        if event == "train.step":
            step, ts = record.get("step"), record.get("ts")
            self.step = step
            self.round_step_seen = True
            now = time.monotonic()
            if self.last_step_at is not None:
                self.longest_gap = max(self.longest_gap, now - self.last_step_at)
                with self._plan_lock:
                    self.step_gaps.append(now - self.last_step_at)
            self.last_step_at = now
            if "first" not in self.span:
                self.span.update(first=step, first_ts=ts)
            self.span.update(last=step, last_ts=ts)
        elif event in FORWARDED:
            last = self.last_checkpoint or Checkpoint(step=None)
            if event == "checkpoint.saved":
                seconds = record.get("seconds")
                if isinstance(seconds, int | float) and seconds >= 0:
                    with self._plan_lock:
                        self.save_seconds.append(float(seconds))
                self.last_checkpoint = Checkpoint(step=record.get("step"), url=record.get("url"),
                                                  interval_s=last.interval_s,
                                                  interval_reason=last.interval_reason,
                                                  save_s=self.save_seconds[-1] if self.save_seconds else None)
            elif event == "checkpoint.interval":  # every="auto" chose (or changed) the durable interval
                self.last_checkpoint = dataclasses.replace(last, interval_s=record.get("interval_s"),
                                                           interval_reason=str(record.get("reason", "")))
            self.events.forward(record if self.round is None or "round" in record
                                else {**record, "round": self.round})


class StatusPublisher:
    """Puts the node's status in etcd when `status_due` says so (see the section's comment): at once on
    a state change (`set_state`), and on `publish()`, which the round loop calls every few seconds, when
    the status changed or its progress backoff ran out. Every publication goes to the mirror.

    clock: monotonic seconds (tests pass their own)."""

    def __init__(self, leases: LeaseClasses, keys: JobKeys, node_id: str, host_addr: str,
                 stats: RequestStats, progress: Progress, outage: OutageReporter,
                 failures: Callable[[], dict[str, int]] = dict, mirror: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.leases = leases
        self.key = keys.node_status(node_id)
        self.node_id = node_id
        self.host_addr = host_addr
        self.stats = stats
        self.progress = progress
        self.outage = outage
        self.failures = failures
        self.mirror = mirror
        self.clock = clock
        self.state = "starting"
        self.round: RoundInfo | None = None
        self.last_error: list[str] = []  # the last failed worker's error lines (NodeStatus.last_error)
        self._put: NodeStatus | None = None  # the status last stored in etcd
        self._put_at = 0.0  # when (clock)
        self._gap = PROGRESS_FIRST  # the progress backoff (next_gap)
        self.puts = 0  # stored puts (tests, the bench)

    def set_state(self, state: str) -> None:
        """A state change: put at once (a transition is rare and is what `petctl status` is for)."""
        self.state = state
        self.publish(force=True)

    def status(self) -> NodeStatus:
        info = self.round if self.state not in ("joining", "waiting") else None
        return NodeStatus(node_id=self.node_id, state=self.state, updated=time.time(),
                          host_addr=self.host_addr, pid=os.getpid(),
                          round=self.round.round if self.round else None,
                          rank=info.rank if info else None, world_size=info.world_size if info else None,
                          restarts=info.restarts if info else None, step=self.progress.step,
                          last_checkpoint=self.progress.last_checkpoint,
                          etcd_requests=self.stats.as_dict(), failures=self.failures(),
                          last_error=list(self.last_error))

    def publish(self, force: bool = False) -> bool:
        """Hand the status to the mirror, and put it in etcd if `force` or `status_due` says so. Returns
        whether it was put; a failed put is counted and reported (once per outage), retried on the next
        call (the stored status did not move), never raised."""
        status = self.status()
        if self.mirror is not None:
            self.mirror.set_status(status.to_dict())
        now = self.clock()
        why = "change" if force else status_due(self._put, status, now - self._put_at, self._gap)
        if why is None:
            return False
        t0 = time.monotonic()
        try:
            self.leases.put(self.key, status.to_json(), STATUS_TTL)
        except store_errors() as e:
            self.outage.failed(e)
            return False
        self.outage.succeeded(time.monotonic() - t0)
        self._put, self._put_at, self._gap = status, now, next_gap(self._gap, why)
        self.puts += 1
        return True
