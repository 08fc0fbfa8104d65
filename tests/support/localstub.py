"""The local reconciler driven through the CLI with a stub agent (a process that only sleeps and leaves on
SIGTERM, after STUB_TERM_DELAY seconds when the job's env sets it), so capacity behaviour is checked fast
and apart from the agent's: the stub and the readers that tests/providers/local/test_reconciler.py and
tests/providers/local/test_detach.py share (the `stub` fixture is conftest's)."""

from __future__ import annotations

import json
import time
from typing import Any

from tests.support.cli import Petctl

STUB_AGENT = '''
import json, os, signal, sys, time
cfg = json.load(open(sys.argv[1]))
def say(event, **kw):
    print(json.dumps({"ts": time.time(), "event": event, "node": cfg["node_id"], **kw}), flush=True)
def leave(*_):
    say("stub.sigterm")
    time.sleep(float(cfg["job"]["env"].get("STUB_TERM_DELAY", 0)))  # a teardown that takes a while
    sys.exit(0)
signal.signal(signal.SIGTERM, leave)
say("stub.started", imds=cfg["imds_endpoint"], work_dir=cfg["work_dir"],
    omp=os.environ.get("OMP_NUM_THREADS"))
if cfg["job"]["env"].get("STUB_EXIT"):
    sys.exit(int(cfg["job"]["env"]["STUB_EXIT"]))
while True:
    time.sleep(0.05)
'''


def start(cli: Petctl, name: str, *args: str) -> None:
    cli.run("run_job", "--name", name, "--min", "1", "--max", "3", *args, str(cli.cwd / "train.py"))


def hosts(cli: Petctl, name: str) -> list[dict[str, Any]]:
    return cli.json("hosts", name, "--all")


def wait_hosts(cli: Petctl, name: str, predicate, timeout: float = 20) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = hosts(cli, name)
        if predicate(rows):
            return rows
        assert time.monotonic() < deadline, f"timed out; hosts: {json.dumps(rows, indent=1)}"
        time.sleep(0.1)


def running(rows: list[dict[str, Any]]) -> list[str]:
    return [r["host_id"] for r in rows if r["state"] == "running"]


def reconciler_events(cli: Petctl, name: str, event: str) -> list[dict[str, Any]]:
    lines = (cli.job_dir(name) / "reconciler.log").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def instance_rows(cli: Petctl, name: str) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in json.loads((cli.job_dir(name) / "instances.json").read_text())}


def instance_events(cli: Petctl, name: str, iid: str, event: str) -> list[dict[str, Any]]:
    lines = (cli.job_dir(name) / "instances" / iid / "agent.log").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]
