"""bench/gpu.py (issue 29) on CPU, so it cannot rot between GPU runs: a tiny state, `--device cpu`.

The smoke run checks that every section is there with figures that make sense, not only that it ran:
the snapshot on file is the last one taken, the store's newest manifest holds the state, a warm worker
reaches its first step sooner than a cold one, the re-form steps again with gloo, the parts that need
CUDA say so. The GPU figures come from the same command on a GPU (bench/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STATE = 0.004e9


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@pytest.mark.slow
def test_the_gpu_bench_runs_on_cpu_with_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--device", "cpu", "--sizes-gb", "0.004",
         "--steps", "16", "--block", "4", "--step-ms", "20", "--saves", "2", "--scratch", str(tmp_path),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == []
    device = doc["device"]
    assert device["kind"] == "cpu" and device["torch"] == torch.__version__
    assert device["name"].startswith("CPU")

    copy = doc["copy"]
    assert _positive(copy["pageable"]["gb_per_s"]) and _positive(copy["pageable"]["ms_per_gb"])
    assert "no CUDA" in copy["pinned"]["skipped"]
    overlap = doc["overlap"]["pageable"]
    assert 0 <= overlap["overlap"] <= 1
    assert all(_positive(overlap[k]) for k in ("step_ms", "copy_ms", "both_ms"))

    warm = doc["warm"]
    cold, hot = warm["cold"], warm["warm"]
    # the warm worker imported torch before its orders: its first step comes sooner, its import at once
    assert cold["launch_to_step_s"] > hot["launch_to_step_s"] > 0, warm
    assert hot["milestones_s"]["worker.imported"] < cold["milestones_s"]["worker.imported"], warm
    assert _positive(hot["warmup_s"])
    forked = warm["forked"]  # the same, forked from the agent's fork server
    assert forked["forked"] is True and forked["fork_reason"] == "", forked
    assert cold["launch_to_step_s"] > forked["launch_to_step_s"] > 0, warm
    assert "no CUDA" in warm["warm_cuda_runtime"]["skipped"]
    assert "no CUDA" in warm["warm_cuda_context"]["skipped"]
    assert warm["reform"]["backend"] == "gloo" and _positive(warm["reform"]["to_step_s"])

    [size] = doc["sizes"]
    snap = size["snap"]
    state_bytes = snap["model"]["state_bytes"]
    assert abs(state_bytes - STATE) / STATE < 0.1, snap["model"]
    assert snap["snapshot_dir"] == "/dev/shm" or "page cache" in snap["dir_note"]
    for key in ("p8", "p8_unpinned"):
        p8 = snap[key]
        assert p8["verified"] and p8["offered_step"] == p8["last_step"] is not None, p8
        assert p8["snapshots"] >= 2 and p8["every"] >= 1, p8
        assert _positive(p8["step_ms_without"]) and _positive(p8["step_ms_with"])
        assert isinstance(p8["overhead_pct"], float)
        writer = p8["writer"]
        assert writer["bytes"] >= state_bytes and writer["pinned"] is False and writer["disabled"] is None
        assert _positive(writer["d2h_gb_per_s"]) and _positive(p8["d2h_ms_per_gb"])
        assert writer["busy_ms"] >= writer["copy_ms"] > 0
    assert snap["p8_unpinned"]["pin"] is False and snap["p8"]["pin"] is True

    save = size["save"]
    for key in ("p4_file", "p4_s3"):
        p4 = save[key]
        assert p4["verified"] and p4["stored_bytes"] >= state_bytes, p4
        assert len(p4["saves"]) == 2, p4
        for s in p4["saves"]:
            assert s["done"] and not s["errors"] and s["bytes"] >= state_bytes, s
            assert _positive(s["stage_s"]) and _positive(s["save_s"]) and s["steps_during"] >= 1, s
        assert p4["stored_step"] == p4["saves"][-1]["step"]

    table = doc["table"]
    assert {r["part"] for r in table} >= {"copy", "overlap", "warm", "P8", "P8 unpinned", "P4 file://",
                                          "P4 s3:// (moto)"}
    assert not [r for r in table if r["value"] in ("error", "missing")], table
    text = out.with_suffix(".md").read_text()
    assert f"torch {torch.__version__}" in text and "| P8 | 0.004 GB: K the cadence picked |" in text


@pytest.mark.slow
def test_past_the_hard_limit_what_was_measured_is_written(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--device", "cpu", "--sizes-gb", "0.004",
         "--steps", "16", "--block", "4", "--step-ms", "20", "--scratch", str(tmp_path),
         "--hard-limit-s", "8", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [e for e in doc["errors"] if e.startswith("watchdog")], doc["errors"]
    assert doc["device"]["kind"] == "cpu"
    # wherever the watchdog landed (a part in flight, or between two), what was not done reads missing:
    # 8 s is far short of the smoke's whole run (25 s and more), so some part always is
    assert any(r["value"] == "missing" for r in doc["table"]), doc["table"]
    assert len(doc.get("sizes", [])) < len(doc["config"]["sizes"]) or any(
        "save" not in size for size in doc["sizes"])
    assert out.with_suffix(".md").exists()


PARENT = """
import subprocess, sys, time
from bench.gpu_step import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_child_of_the_bench_dies_with_it() -> None:
    """What the watchdog's exit relies on: moto_server and the workers do not outlive the bench."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, 9)
    assert not alive


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import gpu

    for argv, says in ((["--sizes-gb", "1,x"], "not a list of numbers"), (["--sizes-gb", "0"], "each > 0"),
                       (["--block", "1"], "--block >= 2")):
        with pytest.raises(SystemExit) as exit_:
            gpu.parse(argv)
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu.parse(["--device", "cuda"])
        assert "no CUDA device" in capsys.readouterr().err


def test_every_failure_is_listed_where_it_happened() -> None:
    from bench.gpu import problems

    doc = {"errors": [], "config": {"error": "not a failure"}, "copy": {"error": "RuntimeError: x"},
           "warm": {"cold": {"error": "exit 1: boom"}, "warm": {"launch_to_step_s": 0.2}},
           "sizes": [{"snap": {"p8": {"verified": False},
                               "p8_unpinned": {"verified": True, "writer": {"disabled": "ValueError: x"}}},
                      "save": {"p4_s3": {"saves": [{"errors": ["ClientError"]}], "verified": True},
                               "p4_file": {"skipped": "disk"}}}]}
    assert problems(doc) == ["copy: RuntimeError: x", "warm.cold: exit 1: boom",
                             "sizes[0].snap.p8: not verified",
                             "sizes[0].snap.p8_unpinned.writer: snapshots disabled: ValueError: x",
                             "sizes[0].save.p4_s3.saves[0].errors: ClientError"]
    assert problems({"errors": [], "copy": {"pageable": {"gb_per_s": 1.0}},
                     "sizes": [{"snap": {"p8": {"verified": True, "writer": {"disabled": None}}}}]}) == []


def test_the_table_says_what_was_skipped_and_what_failed() -> None:
    from bench.gpu_table import markdown, rows

    doc = {"command": "gpu.py", "started": 0.0, "seconds": 1.0, "errors": ["P8 16.0 GB: RuntimeError: boom"],
           "device": {"name": "NVIDIA H100", "torch": "2.x", "cuda": "12.x", "driver": "550", "nccl": "2.21",
                      "cpu_count": 16, "host_available_gb": 100, "shm": "/dev/shm", "shm_free_gb": 60},
           "copy": {"bytes": 10**9, "pageable": {"ms_per_gb": 100.0, "gb_per_s": 10.0},
                    "pinned": {"ms_per_gb": 40.0, "gb_per_s": 25.0}},
           "overlap": {"error": "RuntimeError: no stream"},
           "warm": {"cold": {"skipped": "over the time budget (3 s left)"}},
           "sizes": [{"state_gb": 16.0, "snap": {"model": {}, "p8": {"error": "RuntimeError: boom"}},
                      "save": {"skipped": "device memory: 5.0 GB free"}}]}
    doc["table"] = table = rows(doc)
    by = {(r["part"], r["metric"]): r for r in table}
    assert by[("copy", "device -> host, pinned")]["value"] == 40.0
    assert by[("overlap", "a pinned copy beside a step")]["value"] == "error"
    assert by[("warm", "launch -> first step, cold")]["note"].startswith("over the time budget")
    assert by[("P8", "16.0 GB snapshot")]["value"] == "error"
    assert by[("P4", "16.0 GB")] == {"part": "P4", "metric": "16.0 GB", "value": "skipped", "unit": "",
                                     "note": "device memory: 5.0 GB free"}
    text = markdown(doc)
    assert "driver 550, CUDA 12.x, NCCL 2.21, torch 2.x" in text
    assert "- P8 16.0 GB: RuntimeError: boom" in text


def test_the_s3_part_is_skipped_with_its_reason_where_moto_is_missing(monkeypatch) -> None:
    """A leased GPU machine may lack moto. The part then says so, instead of failing as if moto_server
    were broken."""
    import importlib.util
    from types import SimpleNamespace

    from bench import gpu

    real = importlib.util.find_spec
    monkeypatch.setattr(gpu.importlib.util, "find_spec",
                        lambda name, *a: None if name == "moto" else real(name, *a))
    run = SimpleNamespace(args=SimpleNamespace(s3_max_gb=4.0))
    with pytest.raises(gpu.Skip, match="moto is not installed"):
        gpu.save(run, None, 1.0, "s3")
