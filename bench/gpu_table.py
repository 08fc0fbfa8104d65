"""bench/gpu.py's table: one row per figure (part, metric, value, unit, note), a skipped or failed part as
a row that says so, and the device, driver, CUDA and torch versions above it."""

from __future__ import annotations

import time
from typing import Any

Row = dict[str, Any]


def _row(part: str, metric: str, value: Any, unit: str = "", note: str = "") -> Row:
    return {"part": part, "metric": metric, "value": value, "unit": unit, "note": note}


def _status(part: str, metric: str, section: dict[str, Any] | None) -> Row | None:
    """A row for a section that has no figures: skipped (why) or failed (the error)."""
    if not section:
        return _row(part, metric, "missing")
    if "skipped" in section:
        return _row(part, metric, "skipped", note=section["skipped"])
    if "error" in section:
        return _row(part, metric, "error", note=section["error"])
    return None


def rows(doc: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    copy = doc.get("copy", {})
    for kind in ("pageable", "pinned"):
        section = copy.get(kind) if "error" not in copy else copy
        status = _status("copy", f"device -> host, {kind}", section)
        if status:
            out.append(status)
        else:
            out.append(_row("copy", f"device -> host, {kind}", section["ms_per_gb"], "ms/GB",
                            f"{section['gb_per_s']} GB/s, {copy['bytes'] / 1e9:.3g} GB copied"))
    overlap = doc.get("overlap", {})
    for kind in ("pinned", "pageable"):
        section = overlap.get(kind) if "error" not in overlap else overlap
        if section is None:
            continue
        status = _status("overlap", f"a {kind} copy beside a step", section)
        out.append(status or _row(
            "overlap", f"a {kind} copy beside a step: share of the shorter hidden", section["overlap"], "",
            f"step {section['step_ms']} ms alone, copy {section['copy_ms']} ms alone, "
            f"both {section['both_ms']} ms"))
    out += _warm_rows(doc.get("warm", {}))
    done = set()
    for size in doc.get("sizes", []):
        out += _size_rows(size)
        done.add(size["state_gb"])
    for gb in doc.get("config", {}).get("sizes", []):  # not reached when the watchdog wrote the document
        if gb not in done:
            out.append(_row("P8", f"{gb} GB", "missing"))
    return out


def _warm_rows(warm: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    if "error" in warm:
        return [_row("warm", "warm start", "error", note=warm["error"])]
    for variant in ("cold", "warm", "forked", "warm_cuda_runtime", "warm_cuda_context"):
        section = warm.get(variant)
        status = _status("warm", f"launch -> first step, {variant}", section)
        if status:
            out.append(status)
            continue
        note = ", ".join(f"{k.split('.')[1]} {v} s" for k, v in section.get("milestones_s", {}).items())
        if "warmup_s" in section:
            note += f"; ahead of the orders: {section['warmup_s']} s"
        if section.get("fork_reason"):
            note += f"; spawned, not forked: {section['fork_reason']}"
        out.append(_row("warm", f"launch -> first step, {variant}", section["launch_to_step_s"], "s", note))
    reform = warm.get("reform")
    if reform:
        out.append(_row("warm", f"world-1 re-form -> step again ({reform['backend']})", reform["to_step_s"],
                        "s", f"new process group {reform['pg_s']} s"))
    return out


def _size_rows(size: dict[str, Any]) -> list[Row]:
    gb = size["state_gb"]
    out: list[Row] = []
    snap, save = size.get("snap"), size.get("save")
    status = _status("P8", f"{gb} GB", snap)
    if status:
        out.append(status)
        snap = {}
    for key, label in (("p8", "P8"), ("p8_unpinned", "P8 unpinned")):
        p8 = snap.get(key)
        if p8 is None:
            continue
        status = _status(label, f"{gb} GB snapshot", p8)
        if status:
            out.append(status)
            continue
        w = p8["writer"]
        out += [
            _row(label, f"{gb} GB: step-time overhead at the K picked", p8.get("overhead_at_k_pct"), "%",
                 f"({w['blocked_ms']} + {w['hook_wait_ms']} ms per snapshot) / "
                 f"(K x {p8['step_ms_without']} ms)"),
            _row(label, f"{gb} GB: step-time overhead, first {p8['steps']} steps (K settling)",
                 p8["overhead_pct"], "%", f"{p8['step_ms_without']} -> {p8['step_ms_with']} ms mean step"),
            _row(label, f"{gb} GB: K the cadence picked", p8["every"], "",
                 f"{p8['snapshots']} snapshots, one per {p8['steps_per_snapshot']} steps of the blocks with"),
            _row(label, f"{gb} GB: device -> host per GB (the writer's copy)", p8["d2h_ms_per_gb"], "ms/GB",
                 f"pinned: {w['pinned']}; {w['d2h_ms']} ms per snapshot"),
            _row(label, f"{gb} GB: next optimizer.step held for the copy", w["hook_wait_ms"], "ms",
                 f"training thread's own part {w['blocked_ms']} ms"),
            _row(label, f"{gb} GB: background per snapshot (copy + checksum)", w["busy_ms"], "ms",
                 f"checksum {w['crc_ms']} ms"),
            _row(label, f"{gb} GB: snapshot memory made ready (prepare)", p8["prepare_s"], "s"),
            _row(label, f"{gb} GB: snapshot read back as a resume would", p8["verified"], "",
                 f"step {p8['offered_step']} (last taken {p8['last_step']})"),
        ]
    exact = snap.get("exact")
    if exact is not None:
        out.append(_status("P8", f"{gb} GB exact", exact) or _row(
            "P8", f"{gb} GB: snapshot bit-exact with the next step run at once", exact["verified"], "",
            f"{exact['tensors']} tensors, {exact['differ']} differ; {exact['changed_since']} changed since; "
            f"pinned: {exact['pinned']}"))
    status = _status("P4", f"{gb} GB", save)
    if status:
        return [*out, status]
    for key, label in (("p4_file", "P4 file://"), ("p4_s3", "P4 s3:// (moto)")):
        p4 = save.get(key)
        status = _status(label, f"{gb} GB background save", p4)
        if status:
            out.append(status)
            continue
        for i, s in enumerate(p4["saves"]):
            which = "first save" if i == 0 else "next save (buffers reused)"
            out.append(_row(label, f"{gb} GB {which}: staging on the training thread", s["stage_s"], "s",
                            f"{s.get('stage_ms_per_gb')} ms/GB"))
            out.append(_row(label, f"{gb} GB {which}: step-time overhead while it uploads",
                            s.get("overhead_pct_during"), "%",
                            f"save done in {s['save_s']} s over {s['steps_during']} steps; with the staging: "
                            f"{s.get('overhead_pct_with_stage')} %"))
        out.append(_row(label, f"{gb} GB: newest manifest in the store", p4["verified"], "",
                        f"step {p4['stored_step']}, {p4['stored_bytes']} bytes"))
    return out


def markdown(doc: dict[str, Any]) -> str:
    d = doc["device"]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(doc["started"]))
    head = [f"# bench/gpu.py: {d['name']}", "",
            f"- device: {d['name']} ({d.get('memory_gb', '-')} GB), driver {d.get('driver')}, "
            f"CUDA {d.get('cuda')}, NCCL {d.get('nccl')}, torch {d['torch']}, "
            f"PCIe gen {d.get('pcie_gen')} x{d.get('pcie_width')}",
            f"- host: {d['cpu_count']} CPUs, {d['host_available_gb']} GB available, {d['shm']} "
            f"{d['shm_free_gb']} GB free",
            f"- `{doc['command']}`, {when}, {doc.get('seconds')} s", ""]
    if doc["errors"]:
        head += ["Errors:", *[f"- {e}" for e in doc["errors"]], ""]
    lines = ["| part | metric | value | unit | note |", "|---|---|---|---|---|"]
    for r in doc["table"]:
        lines.append(f"| {r['part']} | {r['metric']} | {r['value']} | {r['unit']} | {r['note']} |")
    return "\n".join(head + lines) + "\n"
