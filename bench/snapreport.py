"""The table rows of issue 16's figures: P8 (what a snapshot at every step costs) and P2's lost steps with
in-memory snapshots against the same petctl without them (`petctl-nosnap`), the anchor of the same run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

P8_GOAL = "<= 1 % of step time"
LABELS = {"snapshot": "petctl (overlapped, K auto)", "sync": "copy at the step end", "none": "no snapshots"}


def snapshot_rows(results: dict[str, Any], row: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows built with `row` (report._row's signature) for P8 and the P2 comparison, when present."""
    rows: list[dict[str, Any]] = []
    for sid in ("P2", "P2-user", "P2-fsdp"):
        summary = (results.get(sid) or {}).get("summary", {})
        with_, without = summary.get("petctl", {}), summary.get("petctl-nosnap", {})
        if with_.get("steps_lost") and without.get("steps_lost"):
            a, b = with_["steps_lost"].get("median"), without["steps_lost"].get("median")
            ratio = "-" if a is None or not b else f"{a / b:.2f}"
            rows.append(row(sid, "steps lost: in-memory snapshots vs none (median)", "petctl ÷ petctl-nosnap",
                            {"median": ratio, "n": with_["steps_lost"].get("n")}, "",
                            note=f"{a} vs {b} steps (checkpoints every 10 steps)"))
    p8 = results.get("P8")
    if not p8:
        return rows
    mb = p8.get("config", {}).get("state_mb")
    summary = p8.get("summary", {})
    for variant in ("snapshot", "sync"):
        s = summary.get(variant, {})
        label = LABELS[variant]
        note = "; ".join(s.get("errors", []))
        overhead = row("P8", f"step-time overhead, {mb} MB snapshot every step", label, s.get("overhead_pct"),
                       "%", note=note)
        overhead["goal"] = P8_GOAL if variant == "snapshot" else ""
        rows.append(overhead)
        rows.append(row("P8", "training thread per snapshot ÷ step time (nothing absorbed)", label,
                        s.get("thread_pct"), "%"))
        rows.append(row("P8", "copy time per 100 MB", label, s.get("copy_ms_per_100mb"), "ms",
                        note="beside the next step" if variant == "snapshot" else "on the training thread"))
        rows.append(row("P8", "training thread per snapshot: own work (wall)", label, s.get("blocked_ms"),
                        "ms"))
        rows.append(row("P8", "training thread per snapshot: own work (its CPU time)", label, s.get("cpu_ms"),
                        "ms"))
        rows.append(row("P8", "training thread per snapshot: next step held for the copy", label,
                        s.get("hook_wait_ms"), "ms"))
        rows.append(row("P8", "checksum per snapshot (background)", label, s.get("crc_ms"), "ms"))
        rows.append(row("P8", "K: a snapshot every K steps", label, s.get("every"), ""))
        rows.append(row("P8", "the first snapshot (maps and faults in the memory)", label, s.get("first_ms"),
                        "ms"))
    base = summary.get("none", {}).get("mean_step_s")
    rows.append(row("P8", "mean step time, no snapshots", "baseline", base, "s"))
    return rows
