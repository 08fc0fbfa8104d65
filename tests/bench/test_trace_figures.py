"""The trace bench's dry path (issue 43): the lead's command line parses; a recorded timeline is accounted
into both figures per system, printed as the table, with a run that fell behind its schedule marked
INVALID and left out of the mean; every result records its commit, dirty flag, machine and command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import run as bench_run
from bench import runmeta
from bench.scenarios import spottrace
from tests.support.tracecases import hand_trace

REPO = Path(__file__).resolve().parents[2]
PRICES = json.loads(spottrace.PRICES.read_text())


def test_the_leads_command_line_parses():
    args = bench_run.parse(["--scenarios", "spot-10-15-notice,spot-10-15-mixed", "--systems",
                            "petctl,torchrun-c10d", "--boot", "90"])
    assert args.boots == [90.0] and args.reps is None
    assert set(args.traces) == {"spot-10-15-notice", "spot-10-15-mixed"}
    assert args.scenario_ids == ["spot-10-15-notice", "spot-10-15-mixed"]
    args = bench_run.parse(["--scenarios", "spot-10-15-notice", "--boot", "90,180", "--reps", "2",
                            "--out", "/tmp/x.json"])
    assert args.boots == [90.0, 180.0] and args.reps == 2 and args.out == "/tmp/x.json"
    assert bench_run.parse([]).boots == [90.0]  # the default boot is AWS-like, not the local 3 s
    assert bench_run.parse([]).time_scale is None  # the trace's own
    assert bench_run.parse(["--scenarios", "spot-10-15-notice", "--time-scale", "1.25"]).time_scale == 1.25
    for bad in (["--boot", "ninety"], ["--reps", "0"], ["--scenarios", "spot-nowhere"],
                ["--time-scale", "0"]):
        with pytest.raises(SystemExit):
            bench_run.parse(bad)


def test_a_replay_at_another_time_scale_stretches_every_window_and_boot_alike():
    path = spottrace.find("spot-10-15-notice")
    own, slow = spottrace.load(path), spottrace.load(path, 1.25)
    assert own.time_scale == 10.0 and slow.time_scale == 1.25 and slow.events == own.events
    assert slow.replay_seconds() == pytest.approx(own.replay_seconds() * 8)


def recorded() -> tuple[list[dict], list[dict]]:
    """The hand-computed trace (tests/bench/test_traceaccount.py) as a run records it."""
    rows, lives = hand_trace()
    records = [{"ts": r.ts, "step": r.step, "world_size": r.world, "node": r.node, "round": r.round}
               for r in rows]
    events = []
    for x in lives:
        events.append({"ts": x.launched, "event": "instance.launched", "instance": x.name})
        if x.booted is not None:
            events.append({"ts": x.booted, "event": "instance.booted", "instance": x.name})
        if x.ended < 100.0:
            events.append({"ts": x.ended, "event": "instance.reclaimed", "instance": x.name})
    return records, events


def test_a_recorded_run_is_accounted_printed_and_the_late_one_left_out():
    records, events = recorded()
    good = spottrace.result(records, events, 0.0, 100.0, 10.0, PRICES, every=1)
    assert good["valid"] and good["outcome"]["goodput_scaled"] == pytest.approx(0.9229, abs=1e-4)
    assert good["outcome"]["goodput_measured"] == pytest.approx(0.875)
    # accounted again from its JSON, the same figures
    again = spottrace.reaccount(json.loads(json.dumps(good)), 10.0, PRICES)
    assert again["outcome"] == good["outcome"]
    late_log = SimpleNamespace(valid=False, max_late_s=2.5, late=[{"what": "reclaim", "due": 37, "at": 39.5}],
                               actions=[], launches=[])
    late = spottrace.result(records, events[:-1], 0.0, 100.0, 10.0, PRICES, log=late_log, every=1)
    assert not late["valid"] and "2.5 s behind" in late["invalid_reason"]
    summary = spottrace.summarize([good, late, {"error": "did not start"}])
    assert summary["valid_runs"] == 1 and summary["invalid_runs"] == 1 and summary["failed_runs"] == 1
    assert summary["mean"]["goodput_scaled"] == good["outcome"]["goodput_scaled"]  # the late run is not in it
    result = {"trace": "hand", "nodes": 3, "counts": {"notice": 1, "loss": 1}, "rate_per_node_hour": 1.0,
              "time_scale": 10.0, "boot_s": 90.0, "boot_replayed_s": 9.0, "prices": PRICES,
              "systems": {"torchrun-c10d": {"runs": [good, late], "summary": summary}}}
    text = spottrace.table(result)
    assert "goodput_scaled" in text and "goodput_measured" in text and "billed node-s" in text
    lines = text.splitlines()
    assert "| 92.3% | 87.5% | 2 | 3 | 312 |" in lines[4]
    assert "INVALID" in lines[5] and "INVALID" not in lines[4]
    assert lines[6].startswith("| torchrun-c10d | mean of 1 valid | 92.3% |")


def test_every_result_records_its_commit_dirty_flag_machine_and_command():
    meta = runmeta.start(["bench/run.py", "--boot", "90"])
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    head = git.stdout.strip()
    assert meta["commit"] == head and isinstance(meta["dirty"], bool)
    assert meta["command"].endswith("bench/run.py --boot 90")
    doc = runmeta.finish(meta)
    m = doc["machine"]
    assert m["cpu_count"] and m["python"] and len(m["load_avg_start"]) == 3 and len(m["load_avg_end"]) == 3
    # bench/run.py writes it with every result
    args = SimpleNamespace(quick=False, boots=[90.0])
    ctx = SimpleNamespace(timeline=[])
    written = bench_run._doc(args, 1, ["spot-10-15-notice"], ["petctl"], 0.0, {}, ctx, meta)
    assert all(written[key] == doc[key] for key in ("commit", "dirty", "command"))
    assert "load_avg_end" in written["machine"] and "load_avg_start" in written["machine"]


def test_a_replay_says_when_its_compression_alone_keeps_the_replacement_from_coming_first():
    """At 10x the window is 12 s and the agent keeps a quarter of it: a 9 s replayed boot cannot beat the
    save, so every hand-off is at its deadline and the table must say the figure understates petctl. At
    1.25x the full 15 s margin leaves 81 s against a 72 s boot; a 180 s boot misses at any scale."""
    assert "never at the replacement" in spottrace.handoff_note(10.0, 90.0)
    assert "x1.25 replays it" in spottrace.handoff_note(10.0, 90.0)
    assert spottrace.handoff_note(1.25, 90.0) == ""
    assert "as it would on AWS" in spottrace.handoff_note(1.25, 180.0)
    assert "as it would on AWS" in spottrace.handoff_note(10.0, 180.0)
    assert spottrace.handoff_note(1.0, 90.0) == ""
