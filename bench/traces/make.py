"""Regenerate the shipped traces (deterministic: the same seeds give the same files, byte for byte).

    python -m bench.traces.make        # writes bench/traces/*.json

How each is derived, and which parts are assumptions, is in its `derivation` field and in
petctl/core/tracegen.py. `smoke` is hand-written for tests/bench/test_trace.py (3 nodes, one notice, one
loss without notice, in 40 s of replay).
"""

from __future__ import annotations

from pathlib import Path

from petctl.core.spottrace import Trace, TraceEvent
from petctl.core.tracegen import generate

HERE = Path(__file__).resolve().parent


def traces() -> list[Trace]:
    out = [generate("spot-10-15-notice", "10-15%", seed=28),  # the headline: every loss noticed
           generate("spot-10-15-mixed", "10-15%", seed=28, silent=1 / 3),  # a third without notice
           generate("spot-15-20-outage", "15-20%", seed=28, silent=1 / 3, outage=(1500.0, 600.0),
                    min_gap=90.0)]  # every node gone for 10 min, then back
    out += [generate(f"spot-{b}", band, seed=28, silent=1 / 3, min_gap=90.0)
            for b, band in (("lt5", "<5%"), ("5-10", "5-10%"), ("15-20", "15-20%"), ("gt20", ">20%"))]
    out.append(Trace(name="smoke", nodes=3, duration=400.0, time_scale=10.0, seed=None, band="",
                     derivation="hand-written for the test suite: one notice, one loss without notice",
                     events=(TraceEvent(at=20.0, kind="notice", node=2, grace=30.0),
                             TraceEvent(at=200.0, kind="loss", node=1))))
    return out


def main() -> int:
    for trace in traces():
        (HERE / f"{trace.name}.json").write_text(trace.to_json())
        print(f"{trace.name}: {trace.counts()} {trace.rate():.2f}/node-hour, "
              f"{trace.replay_seconds():.0f}s replay")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
