"""`petctl chaos --trace`: the replay turns a trace into the provider's chaos calls at their times, maps
slots onto running instances in launch order, sends a rebalance's notice to the same instance, and holds
capacity; a bad trace file is one line and a non-zero exit."""

from __future__ import annotations

from pathlib import Path

from petctl.core.spottrace import Trace, TraceEvent
from petctl.providers.base import HostInfo
from petctl.providers.tracereplay import replay


class FakeProvider:
    chaos_modes = ("kill", "notice", "rebalance")

    def __init__(self, clock) -> None:
        self.clock = clock
        self.hosts_ = [HostInfo(f"i-{k}", "running", "local", "local", "127.0.0.1", launched_at=k)
                       for k in range(4)]
        self.calls: list[tuple] = []

    def hosts(self, name):
        return list(self.hosts_)

    def terminate_host(self, name, host_id, mode="kill", grace=0.0):
        self.calls.append((round(self.clock(), 1), mode, host_id, round(grace, 1)))
        self.hosts_ = [h for h in self.hosts_ if h.host_id != host_id] if mode == "kill" else self.hosts_
        return host_id

    def hold_capacity(self, name, until):
        self.calls.append((round(self.clock(), 1), "hold", round(until, 1)))


def test_replay_calls_the_provider_at_the_trace_times() -> None:
    now = [1000.0]
    provider = FakeProvider(lambda: now[0])
    trace = Trace(name="t", nodes=4, duration=500.0, time_scale=10.0, events=(
        TraceEvent(at=20.0, kind="notice", node=5, return_after=100.0),  # slot 5 of 4 -> i-1
        TraceEvent(at=100.0, kind="loss", node=0),
        TraceEvent(at=200.0, kind="rebalance", node=0, grace=50.0),
        TraceEvent(at=300.0, kind="outage", duration=100.0)))

    def sleep(s: float) -> None:
        now[0] += max(s, 0.01)

    skipped = replay(provider, "job", trace, echo=lambda line: None, clock=lambda: now[0], sleep=sleep)
    assert skipped == 0
    assert provider.calls == [
        (1002.0, "hold", 1000.0 + 2.0 + 12.0 + 10.0),
        (1002.0, "notice", "i-1", 12.0),
        (1010.0, "kill", "i-0", 0.0),
        (1020.0, "rebalance", "i-1", 5.0),  # i-0 is gone: slot 0 is i-1 now
        (1025.0, "notice", "i-1", 12.0),  # the rebalance's notice: the same instance
        (1030.0, "hold", 1000.0 + 30.0 + 12.0 + 10.0),
        (1030.0, "notice", "i-1", 12.0), (1030.0, "notice", "i-2", 12.0), (1030.0, "notice", "i-3", 12.0)]


def test_a_bad_trace_is_one_line_and_nonzero(tmp_path: Path) -> None:
    """Run as a user would (a fresh process): stderr is one line, the exit status non-zero."""
    import os
    import subprocess
    import sys

    bad = tmp_path / "t.json"
    bad.write_text('{"nodes": 2, "duration": 10, "events": [{"at": 1, "kind": "meteor"}]}')
    env = {**os.environ, "PETCTL_HOME": str(tmp_path / "home")}
    for path, words in ((bad, "kind 'meteor'"), (tmp_path / "none.json", "cannot read trace")):
        run = subprocess.run([sys.executable, "-m", "petctl", "chaos", "job", "--trace", str(path)],
                             capture_output=True, text=True, env=env, timeout=60)
        assert run.returncode != 0 and words in run.stderr, run.stderr
        assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr
