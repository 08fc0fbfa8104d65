"""Process plumbing shared by the runners: a "node" is a process tree started in its own session.

A node's tree is found through /proc (torchrun puts its workers in sessions of their own, so a process
group signal would miss them); freezing or killing a node signals every process of its tree, which is
what a vanished host or a reclaimed instance does to the processes on it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.core.eventlog import parse_line

# torchrun's agent logs (LOGLEVEL=INFO, glog format) turned into events, so its phases can be timed too.
GLOG_RE = re.compile(r"^I(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) ")
TORCHRUN_LINES = {
    "will restart worker group": "torchrun.detect",
    "new nodes from group_rank": "torchrun.detect",
    "Rendezvous'ing worker group": "torchrun.rendezvous_start",
    "Rendezvous complete for workers": "rendezvous.complete",
}


def parse_glog(line: str) -> dict[str, Any] | None:
    m = GLOG_RE.match(line)
    if not m:
        return None
    for needle, event in TORCHRUN_LINES.items():
        if needle in line:
            month, day, hh, mm, ss, frac = m.groups()
            now = time.localtime()
            ts = time.mktime((now.tm_year, int(month), int(day), int(hh), int(mm), int(ss), 0, 0, -1))
            return {"ts": ts + float("0." + frac), "event": event, "source": "torchrun-log"}
    return None


def children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(entry))
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    kids = children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def signal_tree(pid: int, sig: int) -> None:
    for p in tree(pid):  # parent first: a frozen parent cannot react to its children stopping
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, sig)  # same-group children that were forked in between
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Node:
    """One simulated instance: a process started in its own session, its output in `log`."""

    name: str
    proc: subprocess.Popen
    log: Path
    started: float
    _cache: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0

    def events(self, name: str | None = None, after: float | None = None) -> list[dict[str, Any]]:
        """Every event line in the log so far (read incrementally)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            data = b""
        cut = data.rfind(b"\n") + 1
        if cut:
            for line in data[:cut].decode("utf-8", "replace").splitlines():
                record = parse_line(line) or parse_glog(line)
                if record is not None:
                    self._cache.append(record)
            self._offset += cut
        return [r for r in self._cache if (name is None or r["event"] == name)
                and (after is None or float(r["ts"]) >= after)]

    def signal(self, sig: int) -> None:
        signal_tree(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def start_node(name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None,
               cwd: str | Path | None = None) -> Node:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
    return Node(name, proc, log, time.time())


def stop_nodes(nodes: list[Node], timeout: float = 10.0) -> None:
    for node in nodes:
        node.kill()
    for node in nodes:
        try:
            node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    # Orphans (a worker whose parent died first) are still in the node's session: end them too.
    for node in nodes:
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """The predicate's first truthy value, or None after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)
