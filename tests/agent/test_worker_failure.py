"""Why a worker failed, carried from its output to `petctl status`: the agent keeps each worker's last
lines that are not events (`WorkerGroup.error_tail`), and the read side picks the failure that ended the
job (`petctl.jobview.failure.last_failure`). Real processes, no torch: fast."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

from petctl.agent.workers import ERROR_LINE_CHARS, ERROR_TAIL_LINES, WorkerGroup, WorkerSpec
from petctl.jobview.failure import MAX_LINES, last_failure

# Events interleaved with plain output, then a traceback longer than the tail, then a non-zero exit.
FAILING = '''
import json, os, sys, time
for step in range(3):
    print(json.dumps({"ts": time.time(), "event": "train.step", "step": step}), flush=True)
print("plain output before the failure", flush=True)
print("x" * 1000, flush=True)
lines = [f"  frame {i}" for i in range(30)]
sys.stderr.write("Traceback (most recent call last):\\n" + "\\n".join(lines) + "\\n")
print(json.dumps({"ts": time.time(), "event": "train.step", "step": 3}), flush=True)
sys.stderr.write(f"RuntimeError: injected failure on rank {os.environ['RANK']}\\n")
sys.exit(3)
'''


def run_group(tmp_path: Path, source: str, nproc: int = 2, seen: list[dict] | None = None) -> WorkerGroup:
    (tmp_path / "w.py").write_text(source)
    spec = WorkerSpec(cmd=[sys.executable, "-u", "w.py"], cwd=str(tmp_path), nproc=nproc)
    group = WorkerGroup(spec, io.StringIO(), on_event=None if seen is None else seen.append)
    group.start(node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=1, restart_count=0,
                max_restarts=0, run_id="t", extra_env={})
    deadline = time.monotonic() + 30
    while (result := group.poll()) is None or len(result.exit_codes) < nproc:
        assert time.monotonic() < deadline, "the workers did not exit"
        time.sleep(0.02)
    assert result.exit_codes == dict.fromkeys(range(nproc), 3)
    return group


def test_the_tail_holds_the_last_error_lines_and_no_events(tmp_path: Path) -> None:
    seen: list[dict] = []
    group = run_group(tmp_path, FAILING, seen=seen)
    for local_rank in (0, 1):
        tail = group.error_tail(local_rank)
        assert len(tail) == ERROR_TAIL_LINES
        assert tail[-1] == f"RuntimeError: injected failure on rank {local_rank}"
        assert tail[-2] == "  frame 29" and tail[0] == f"  frame {30 - ERROR_TAIL_LINES + 1}"
        assert not any('"event"' in line for line in tail)
    assert [e["step"] for e in seen].count(3) == 2  # the events still reached the agent, not the tail
    group.stop(1.0)


def test_a_long_line_is_cut_and_a_short_tail_is_whole(tmp_path: Path) -> None:
    source = "import sys\nprint('y' * 5000, flush=True)\nprint('the end', flush=True)\nsys.exit(3)\n"
    group = run_group(tmp_path, source, nproc=1)
    assert group.error_tail(0) == ["y" * ERROR_LINE_CHARS, "the end"]
    assert group.error_tail(7) == []  # no such worker: nothing, not an error


def test_the_launchers_frames_leave_room_for_the_scripts_own(tmp_path: Path) -> None:
    """A warm worker runs the script through runpy: those frames say nothing about the user's error."""
    source = """import sys
sys.stderr.write('Traceback (most recent call last):\\n')
sys.stderr.write('  File "/x/petctl/agent/warm_worker.py", line 60, in main\\n    runpy.run_path(path)\\n')
sys.stderr.write('  File "/usr/lib/python3.11/runpy.py", line 291, in run_path\\n    return run(code)\\n')
sys.stderr.write('  File "train.py", line 9, in <module>\\n    step()\\n')
sys.stderr.write('    ^^^^^^\\nValueError: bad batch\\n')
sys.exit(3)
"""
    group = run_group(tmp_path, source, nproc=1)
    assert group.error_tail(0) == ["Traceback (most recent call last):",
                                   '  File "train.py", line 9, in <module>', "    step()", "    ^^^^^^",
                                   "ValueError: bad batch"]


def failed(node: str, round_no: int, ts: float, lines: list[str] | None = None) -> dict:
    event = {"ts": ts, "event": "workers.failed", "node": node, "round": round_no, "local_rank": 0, "code": 1}
    return event if lines is None else {**event, "last_error": lines}


def test_the_failure_shown_is_the_first_of_the_last_failed_round() -> None:
    events = [failed("n1", 1, 10.0, ["old"]), {"ts": 11.0, "event": "train.step", "step": 3},
              failed("n2", 3, 30.5, ["RuntimeError: Connection closed by peer"]),
              failed("n1", 3, 30.0, ["Traceback (most recent call last):", "ValueError: the cause"]),
              failed("n2", 2, 20.0, ["older"])]
    failure = last_failure(events)
    assert failure is not None
    assert (failure.node, failure.round, failure.lines, failure.others) == (
        "n1", 3, ["Traceback (most recent call last):", "ValueError: the cause"], 1)
    block = failure.block()
    assert block[0] == ("last worker error (node n1, round 3, local rank 0, exit code 1; 1 other node(s) "
                        "failed after it):")
    assert block[1:] == ["    Traceback (most recent call last):", "    ValueError: the cause"]


def test_the_cause_is_shown_even_when_its_echo_was_reported_first() -> None:
    """Each agent notices its workers' exit at its own next poll: the peer that failed in a collective
    because the cause died may report first. Its words name it an echo (gloo, NCCL)."""
    for echo in ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                 "peer [127.0.0.1]:2345",
                 "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3763, remote "
                 "process exited or there was a network error, NCCL version 2.28.8"):
        events = [failed("n2", 3, 30.0, ["Traceback (most recent call last):", echo]),
                  failed("n1", 3, 30.4, ["Traceback (most recent call last):", "ValueError: the cause"])]
        failure = last_failure(events)
        assert failure is not None
        assert (failure.node, failure.lines[-1], failure.others) == ("n1", "ValueError: the cause", 1)
    # Every report an echo (the cause printed nothing, or was killed): the first report, as before.
    only_echoes = [failed("n2", 3, 30.0, ["Connection closed by peer"]),
                   failed("n3", 3, 30.2, ["Connection reset by peer"])]
    failure = last_failure(only_echoes)
    assert failure is not None and (failure.node, failure.others) == ("n2", 1)


def test_no_failure_and_old_agents_without_lines() -> None:
    assert last_failure([{"ts": 1.0, "event": "train.step"}]) is None
    failure = last_failure([failed("n1", 2, 5.0)])  # an agent from before last_error
    assert failure is not None and failure.lines == []
    assert failure.block()[1] == "    (the worker printed nothing but events)"
    many = last_failure([failed("n1", 1, 1.0, [str(i) for i in range(50)])])
    assert many is not None and len(many.block()) == 1 + MAX_LINES and many.block()[-1] == "    49"
