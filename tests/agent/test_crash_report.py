"""`agent.crashed` carries the traceback: the cause of a crash is in the job's events, not only in the log
of an instance that is about to be replaced (AWS marks it unhealthy at once on exit 70)."""

from __future__ import annotations

import json

from petctl.agent.health import traceback_tail
from petctl.agent.main import EXIT_CRASHED, main
from petctl.core.spec import AgentConfig
from tests.support.agent_harness import make_spec


def test_a_crash_before_the_agent_runs_reports_its_traceback(tmp_path, capsys):
    spec = make_spec("crash-report", "not-an-endpoint", min_size=1, max_size=1)  # refused by parse_endpoints
    config = tmp_path / "agent.json"
    config.write_text(AgentConfig(job=spec, node_id="n1", work_dir=str(tmp_path)).to_json())
    assert main(["--config", str(config)]) == EXIT_CRASHED == 70
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    (crash,) = [e for e in events if e["event"] == "agent.crashed"]
    assert crash["error"] == ("ValueError: invalid etcd endpoint 'not-an-endpoint': expected "
                              "http://host:port or https://host:port")
    lines = crash["traceback"]
    assert lines[-1] == crash["error"] and 1 < len(lines) <= 20
    # where it was raised
    assert any("petctl/core/endpoints.py" in line and "in split_endpoints" in line for line in lines)


def test_traceback_tail_keeps_the_last_lines():
    def ping(n: int) -> None:  # two alternating frames: Python collapses only identical repeats
        if n:
            pong(n - 1)
        raise KeyError("bottom")

    def pong(n: int) -> None:
        ping(n)

    try:
        ping(30)
    except KeyError as e:
        tail = traceback_tail(e, lines=20)
    lines = tail
    assert len(lines) == 20 and lines[-1] == "KeyError: 'bottom'" and "in ping" in lines[-3]
    assert not tail[0].startswith("Traceback")  # 30 frames: the head was cut, the raising end kept
