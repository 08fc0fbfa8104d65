"""Count spurious drops in the node logs of a test run: every `membership.lost`, and whether it was real.

    python -m bench.drops /tmp/pt-slow [more basetemps...]

A drop of node X at time t is real when X's heartbeat really stopped: X reported a `heartbeat.gap` (the
time between two of its applied refreshes) that spans t (it was frozen, stalled or cut off), or its agent
never wrote again (killed). It is spurious when X kept refreshing and found its own key gone
(`heartbeat.lost` with no gap around t): a live node dropped. Anything else is listed as `check` (X wrote
again but never found its key gone: stopped by the test right after, for instance). Also lists every
`heartbeat.gap` outside an etcd outage: how close live nodes came to the 1 s limit.

The local provider's tests remove their node logs at teardown: run them with `-p bench.keeplogs` to keep
a copy in each test's tmp dir.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

from petctl.core.eventlog import parse_line

Record = dict[str, Any]


def node_logs(root: Path) -> dict[str, dict[tuple[str, str], list[Record]]]:
    """test dir -> (node, job) -> the records of that agent's log (its events and its workers' lines)."""
    out: dict[str, dict[tuple[str, str], list[Record]]] = collections.defaultdict(dict)
    for log in root.rglob("*.log"):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        recs = [r for r in map(parse_line, text.splitlines()) if r is not None and "ts" in r]
        agent = next((r for r in recs if r.get("component") == "agent" and r.get("node")), None)
        if agent is not None:
            out[log.relative_to(root).parts[0]][(agent["node"], agent.get("job", ""))] = recs
    return out


def classify(t: float, recs: list[Record]) -> tuple[str, str]:
    """(verdict, why) for a drop at `t` of the node whose log is `recs`: ok, SPURIOUS or check."""
    for e in recs:
        if e["event"] == "heartbeat.gap" and float(e["ts"]) - float(e["seconds"]) <= t <= float(e["ts"]):
            return "ok", f"its heartbeat was silent {e['seconds']} s"
    if any(e["event"] == "heartbeat.lost" and float(e["ts"]) > t for e in recs):
        return "SPURIOUS", "it kept refreshing and found its key gone"
    if not any(e.get("component") == "agent" and float(e["ts"]) > t for e in recs):
        return "ok", "its agent never wrote again (killed)"
    return "check", "wrote again, never found its key gone"


def report(roots: list[Path]) -> tuple[dict[str, int], list[str]]:
    counts: dict[str, int] = collections.Counter()
    lines: list[str] = []
    for root in roots:
        for test, nodes in sorted(node_logs(root).items()):
            seen: set[tuple[str, str, Any]] = set()
            for (_node, job), recs in nodes.items():
                for e in recs:
                    if e["event"] == "heartbeat.gap" and not _store_out(recs, e):
                        lines.append(f"gap {e['seconds']} s: {test} {job} {_node}")
                    if e["event"] != "membership.lost":
                        continue
                    for x in e.get("nodes") or []:
                        if (job, x, e.get("round")) in seen:
                            continue  # several survivors declaring the same loss
                        seen.add((job, x, e.get("round")))
                        verdict, why = classify(float(e["ts"]), nodes.get((x, job), []))
                        counts[verdict] += 1
                        lines.append(f"{verdict:8} {test} job={job} lost={x} round={e.get('round')}: {why}")
    return counts, lines


def _store_out(recs: list[Record], gap: Record) -> bool:
    """Whether etcd was out of reach around this gap (then every node's refreshes stopped)."""
    end = float(gap["ts"])
    start = end - float(gap["seconds"])
    return any(r["event"] in ("store.unreachable", "store.reachable")
               and start - 1 <= float(r["ts"]) <= end + 1 for r in recs)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if not args:
        print("usage: python -m bench.drops BASETEMP [BASETEMP...]", file=sys.stderr)
        return 2
    counts, lines = report([Path(a) for a in args])
    print("\n".join(lines))
    print(f"drops: {sum(counts.values())}; real: {counts['ok']}; spurious: {counts['SPURIOUS']}; "
          f"to check: {counts['check']}")
    return 1 if counts["SPURIOUS"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
