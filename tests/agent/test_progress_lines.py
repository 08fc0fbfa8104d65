"""Issue 25, defect 1: a worker's progress bar must not hide its step reports from the agent.

The Hugging Face Trainer draws a tqdm bar on stderr by default (`\\r` and no newline), which the agent
reads merged with stdout: the next `train.step` line was glued behind the bar and not parsed, so a
round's summary lagged the steps the worker printed, and `status` counted fewer kept and lost steps than
the ledger. Here a real worker process does what the Trainer does (tqdm on stderr, the callback's
`train.step` lines on stdout) and writes its own ledger; the agent's view of the round (Progress span ->
round.summary -> accounting) must match the ledger. Real processes, no torch: fast.
"""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

from petctl.agent.reporting import Progress
from petctl.agent.workers import WorkerGroup, WorkerSpec
from petctl.core.eventlog import parse_events, parse_line, parse_lines
from petctl.io.eventlog import EventLog
from petctl.jobview.accounting import account

STEPS = 12
WORKER = f'''
import json, sys, time
from tqdm import tqdm
from petctl.io.eventlog import EventLog
events = EventLog("elastic", stream=sys.stdout)
with open("ledger.jsonl", "w") as ledger:
    for step in tqdm(range(1, {STEPS} + 1), mininterval=0):  # stderr, redrawn with \\r at every step
        time.sleep(0.01)
        events.emit("train.step", step=step, rank=0, world_size=1)
        ledger.write(json.dumps({{"step": step}}) + "\\n")
'''


def test_a_step_line_glued_behind_a_progress_bar_is_still_an_event():
    line = '\r 17%|\u2588\u258b    | 2/12 [00:00<00:04, 2.05it/s]{"ts":1.5,"event":"train.step","step":3}'
    assert parse_line(line) == {"ts": 1.5, "event": "train.step", "step": 3}
    nested = '{"ts":2,"event":"x","inner":{"ts":3,"event":"y"}}'
    assert parse_line("\r bar " + nested) == json.loads(nested)  # the first event start is the line's
    assert parse_line("\r 50%|#####     | 6/12") is None


def test_two_events_glued_on_one_line_are_both_read():
    """A script's own `print` (text, then the newline: two writes) and petctl's background save thread
    can interleave: `{...}{...}` then one newline. Both are events (a rebalance's `checkpoint.saved` was
    lost this way under load)."""
    user = '{"ts": 1.5, "event": "train.step", "step": 35, "rank": 0}'  # json.dumps' default spacing
    ours = '{"ts":1.6,"event":"checkpoint.saved","step":34,"seconds":0.005}'
    assert parse_events(user + ours + "\n") == [json.loads(user), json.loads(ours)]
    assert parse_line(user + ours) == json.loads(user)
    assert parse_events("\r bar {not json} " + ours + " trailing") == [json.loads(ours)]
    assert parse_events('{"ts": 1, "event": "a"}{"ts": broken') == [{"ts": 1, "event": "a"}]
    assert list(parse_lines([user + ours, "plain output", ours])) == [json.loads(user), json.loads(ours),
                                                                     json.loads(ours)]


def test_the_round_summary_and_accounting_match_the_ledger_under_a_progress_bar(tmp_path: Path):
    (tmp_path / "w.py").write_text(WORKER)
    spec = WorkerSpec(cmd=[sys.executable, "-u", "w.py"], cwd=str(tmp_path), nproc=1,
                      base_env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    progress = Progress(nproc=1, events=EventLog("agent", stream=io.StringIO()))
    group = WorkerGroup(spec, io.StringIO(), on_event=progress.on_worker_event)
    group.start(node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=1, restart_count=0,
                max_restarts=0, run_id="t", extra_env={})
    assert group.wait_exit(60), "the worker did not finish"
    group.stop(1.0)  # joins the output readers: every line is read
    assert group.poll() is not None and group.poll().succeeded
    ledger = [json.loads(line)["step"] for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert ledger == list(range(1, STEPS + 1))
    span = progress.span
    assert (span.get("first"), span.get("last")) == (ledger[0], ledger[-1]), span
    summary = {"ts": time.time(), "event": "round.summary", "node": "n1", "round": 1, "rank": 0,
               "world_size": 1, "started": group.started_at, "ended": time.time(),
               "first_step": span["first"], "last_step": span["last"],
               "first_step_ts": span["first_ts"], "last_step_ts": span["last_ts"]}
    acc = account([summary])
    assert (acc.steps_kept, acc.steps_lost) == (len(ledger), 0)


def test_the_workers_loads_and_saves_reach_the_sinks_stamped_with_their_round():
    """A round whose every member dies writes no summary; `status` then learns its span from these
    (jobview/accounting.py `_unseen_span`), so they must say which round they belong to."""
    sunk: list[dict] = []
    events = EventLog("agent", stream=io.StringIO())
    events.add_sink(sunk.append)
    progress = Progress(nproc=1, events=events)
    progress.begin_round(7)
    progress.on_worker_event({"event": "checkpoint.loaded", "step": 40, "rank": 0})
    progress.on_worker_event({"event": "checkpoint.saved", "step": 49, "rank": 0, "seconds": 0.1})
    progress.on_worker_event({"event": "checkpoint.saved", "step": 59, "rank": 0, "round": 3})  # its own
    assert [(e["event"], e["step"], e["round"]) for e in sunk] == [
        ("checkpoint.loaded", 40, 7), ("checkpoint.saved", 49, 7), ("checkpoint.saved", 59, 3)]


def test_the_step_time_is_the_median_of_the_latest_gaps():
    """What a noticed node plans its hand-off with (notices.py): the median step gap, odd or even count."""
    progress = Progress(1, EventLog("agent", stream=io.StringIO()))
    assert progress.step_time() == 0.0
    progress.step_gaps.extend([0.3, 0.1, 0.2])
    assert progress.step_time() == 0.2
    progress.step_gaps.append(0.9)
    assert progress.step_time() == 0.25
