"""`petctl events` and `petctl report` on a real local job: the timeline, goodput, the PNG chart, and
the record surviving the loss of etcd's copy (the agents' mirror in the job's prefix)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import Petctl, write_script

pytestmark = pytest.mark.slow

SCRIPT = """
import json, os, time
import torch.distributed as dist
dist.init_process_group("gloo")
for step in range(8):
    print(json.dumps({"ts": time.time(), "event": "train.step", "step": step, "rank": dist.get_rank(),
                      "world_size": dist.get_world_size()}), flush=True)
    time.sleep(0.1)
dist.destroy_process_group()
"""


def test_events_and_report_of_a_finished_job(local: Petctl, tmp_path):
    script = write_script(tmp_path, "eight_steps.py", SCRIPT)
    local.run("run_job", "--name", "ins", "--min", "1", "--max", "1", str(script))
    assert local.wait_finished("ins", timeout=120)["state"] == "succeeded"

    names = [e["event"] for e in local.json("events", "ins")]
    for expected in ("instance.launched", "agent.started", "rendezvous.complete", "workers.succeeded",
                     "job.result", "agent.exit"):
        assert expected in names, names
    assert "round.summary" not in names and "round.summary" in [e["event"] for e in
                                                                local.json("events", "ins", "--all")]

    lines = [json.loads(line) for line in local.run("logs", "ins", "-o", "json").stdout.splitlines()]
    steps = [r["event"]["step"] for r in lines if r.get("event", {}).get("event") == "train.step"]
    assert steps == list(range(8)) and all(r["node"] for r in lines)

    png = tmp_path / "chart.png"
    report = local.json("report", "ins", "--png", str(png))
    assert report["state"] == "succeeded"
    assert (report["steps_kept"], report["steps_lost"]) == (8, 0)
    assert (report["reforms"], report["failure_restarts"]) == (0, 0)
    assert 0 < report["goodput"] < 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # etcd forgets (TTL, a new etcd): the mirror in the job's prefix still tells the story.
    from contextlib import closing

    from petctl.core.keys import JobKeys

    with closing(local.store()) as store:
        assert store.delete_dir(JobKeys("ins").events) > 0
        assert store.list(JobKeys("ins").events).entries == ()
    assert [e["event"] for e in local.json("events", "ins")] == names


def test_events_of_an_unknown_job_is_one_line_error(shared_local: Petctl):
    proc = shared_local.run("events", "nope", check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "nope" in proc.stderr
