"""The run's results as rows (one table for the terminal, the JSON and the README), and the chart.

`python -m bench.report results.json` prints the table, rewrites its `.md` and redraws the chart of a
saved run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import phases
from bench.snapreport import snapshot_rows

GOALS = {
    "P1": "<= 3 s median, 0 steps lost",
    "P2": "<= 10 s",
    "P3": "<= 5 s; old members' stall <= 1 s, 0 steps lost",
    "P4": "<= 1 % (petctl)",
    "P5": "<= 1.5 s at N=64 and <= torchrun's fastest rep, requests/node flat in N",
    "P6": "<= 0.3 s",
    "P7a": "0 restarts, 0 steps lost",
    "P7b": "0 restarts, 0 steps lost",
}
TORCHRUNS = ("torchrun-c10d", "torchrun-etcd-v2")
# P1-P3 result keys (recovery.result_key): "P1", "P1-user", "P1-hf-burst", ...; table order is the
# scenario, then the workload in this order (others after, by name), each with its burst run after it.
WORKLOAD_ORDER = ("", "user", "fsdp", "hf", "lightning")
BURST_GOAL = "<= 1 s median, <= 2 s p90, 0 steps lost"
FRAMEWORK_GOAL = "<= 1.5 s median, 0 steps lost"
# Figures beside a recovery's time, when measured: summary key, metric, unit, goal ("": the scenario's).
RECOVERY_EXTRAS = [("detect_s", "freeze -> first survivor detects", "s", "<= 1.5 s, 0 spurious drops"),
                   ("all_know_s", "freeze -> every survivor knows", "s", "<= 1.5 s, 0 spurious drops"),
                   ("steps_lost", "steps lost", "steps", "0"),
                   ("stall", "old members' stall (last step -> first at the new world)", "s", "")]
BASELINE_NOTES = {"petctl-ttl3": "before issue 16: TTL-only detection (1 s refreshes, 3 s TTL)"}
WORKLOAD_LABEL = {"": "", "user": " (user script)", "fsdp": " (user script, FSDP2)",
                  "hf": " (HF Trainer example)", "lightning": " (Lightning example)"}


def recovery_keys(results: dict[str, Any]) -> list[str]:
    """The P1-P3 keys present in `results`, in table order."""
    def order(key: str) -> tuple[str, int, str, bool]:
        base, _, rest = key.partition("-")
        burst = rest == "burst" or rest.endswith("-burst")
        workload = rest.removesuffix("burst").removesuffix("-")
        rank = WORKLOAD_ORDER.index(workload) if workload in WORKLOAD_ORDER else len(WORKLOAD_ORDER)
        return base, rank, workload, burst
    return sorted((k for k in results if k.split("-")[0] in ("P1", "P2", "P3")), key=order)


def _label(sid: str) -> tuple[str, str]:
    """(the workload's label, the goal when it is not the scenario's) of a recovery key."""
    _, _, rest = sid.partition("-")
    burst = rest == "burst" or rest.endswith("-burst")
    workload = rest.removesuffix("burst").removesuffix("-")
    label = WORKLOAD_LABEL.get(workload, f" ({workload})" if workload else "")
    if burst:
        label += ", notice 0-30 s after the round formed"
    goal = BURST_GOAL if burst else FRAMEWORK_GOAL if workload in ("hf", "lightning") else ""
    return label, goal


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"
    return f"{v}{unit}"


def _p5_ratios(mine: dict[str, Any], anchors: dict[str, dict[str, Any]], metric: str) -> dict[str, str]:
    """petctl's median of a P5 `metric` over each anchor's (a torchrun summary at the same N)."""
    return {t: _ratio((mine.get(metric) or {}).get("median"), (theirs.get(metric) or {}).get("median"))
            for t, theirs in anchors.items()}


def _ratio(p: float | None, t: float | None, t_capped: float | None = None) -> str:
    if p is None:
        return "-"
    if t is None and t_capped:
        return f"< {p / t_capped:.2f}"
    if not t:
        return "-"
    return f"{p / t:.2f}"


def _row(sid: str, metric: str, system: str, s: dict[str, Any] | None, unit: str = "",
         ratios: dict[str, str] | None = None, note: str = "", goal: str = "") -> dict[str, Any]:
    s = s or {}
    return {"scenario": sid, "metric": metric, "system": system, "min": s.get("min"),
            "median": s.get("median"), "max": s.get("max"), "n": s.get("n"), "unit": unit,
            "goal": (goal or GOALS.get(sid.split("-")[0], "")) if system == "petctl" else "",
            "ratios": ratios or {}, "note": note}



def build_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for sid in recovery_keys(results):
        res = results.get(sid)
        if not res:
            continue
        summ = res.get("summary", {})
        p = summ.get("petctl", {})
        pmed = (p.get("seconds") or {}).get("median")
        base = sid.split("-")[0]
        label, goal = _label(sid)
        metric = {"P1": "notice -> step again", "P2": "freeze -> step again",
                  "P3": "4th node launched -> step at world 4"}[base] + label
        for system, s in summ.items():
            note = ""
            if s.get("capped_runs"):
                note = f"{s['capped_runs']} run(s) > {s['cap']:.0f} s cap (still hung)"
            if s.get("errors"):
                note += f" errors: {'; '.join(s['errors'])}"
            ratios = {}
            if system == "petctl":
                for t in TORCHRUNS:
                    ts = summ.get(t)
                    if ts:
                        tmed = (ts.get("seconds") or {}).get("median")
                        all_capped = ts.get("capped_runs") and ts["seconds"].get("n", 0) == 0
                        ratios[t] = _ratio(pmed, tmed, ts.get("cap") if all_capped else None)
            sec = dict(s.get("seconds") or {})
            if s.get("capped_runs") and not sec.get("n"):
                sec = {"min": f"> {s['cap']:.0f}", "median": f"> {s['cap']:.0f}", "max": f"> {s['cap']:.0f}",
                       "n": 0}
            if sec.get("p90") is not None and sid.endswith("-burst"):
                note = f"p90 {_fmt(sec['p90'], ' s')} {note}"
            rows.append(_row(sid, metric, system, sec, "s", ratios, note.strip(), goal=goal))
            for key, extra, unit, extra_goal in RECOVERY_EXTRAS:
                if key in s:
                    rows.append(_row(sid, extra + label, system, s[key], unit,
                                     note=BASELINE_NOTES.get(system, ""), goal=extra_goal))
    p4 = results.get("P4")
    if p4:
        cfg = p4.get("config", {})
        for variant in ("elastic", "sync"):
            s = p4["summary"].get(variant, {})
            label = "petctl" if variant == "elastic" else "sync torch.save+upload"
            rows.append(_row("P4", f"step-time overhead, {cfg.get('state_mb')} MB every {cfg.get('every')} "
                             f"steps", label, s.get("overhead_pct"), "%",
                             note="; ".join(s.get("errors", []))))
        rows.append(_row("P4", "mean step time, no checkpoints", "baseline",
                         p4["summary"].get("none", {}).get("mean_step_s"), "s"))
    p5 = results.get("P5")
    if p5:
        for n in p5.get("sizes", []):
            pkey = f"petctl/N={n}"
            psum = p5["summary"].get(pkey, {})
            for key, s in p5["summary"].items():
                system, _, size = key.partition("/N=")
                if int(size) != n:
                    continue
                anchors = {t: ts for t in TORCHRUNS if system == "petctl"
                           and (ts := p5["summary"].get(f"{t}/N={n}")) and not ts.get("skipped")}
                note = s.get("skipped") or "; ".join(s.get("errors", []))
                rows.append(_row("P5", f"N={n} rendezvous (all agents up -> all ranked)", system,
                                 s.get("rdzv_s"), "s", _p5_ratios(psum, anchors, "rdzv_s"), note or ""))
                if (s.get("entered_s") or {}).get("median") is not None:
                    rows.append(_row("P5", f"N={n} rendezvous (all in their first rendezvous -> all ranked)",
                                     system, s["entered_s"], "s", _p5_ratios(psum, anchors, "entered_s"),
                                     note="torchrun's up line is its entry; petctl's entry is after its "
                                          "store session, lease and watches"))
                rows.append(_row("P5", f"N={n} launch -> every worker ran", system,
                                 s.get("launch_to_workers_s"), "s"))
                if s.get("rdzv_requests_per_node") is not None:
                    rows.append(_row("P5", f"N={n} etcd requests/node to form the round (agent count)",
                                     system, {"median": s["rdzv_requests_per_node"], "n": 1}, "",
                                     note=f"closer (max): {s.get('rdzv_requests_max_node')}"))
                if s.get("rdzv_keys_per_node") is not None:
                    rows.append(_row("P5", f"N={n} keys read/node to form the round (agent count)", system,
                                     {"median": s["rdzv_keys_per_node"], "n": 1}, "",
                                     note=f"most by one node: {s.get('rdzv_keys_max_node')}; whole reads of "
                                          "live/ and of the join records, one key per node"))
                if (s.get("agent_cpu_to_ranked_s") or {}).get("median") is not None:
                    started, then = s.get("agent_cpu_to_started_s"), s.get("agent_cpu_started_to_ranked_s")
                    rows.append(_row("P5", f"N={n} agent CPU s, launch -> ranked (mean per agent)", system,
                                     s["agent_cpu_to_ranked_s"], "s",
                                     note=f"busiest agent {s.get('agent_cpu_to_ranked_max_s')} s; to "
                                          f"agent.started (start-up, imports) {started} s, then to ranked "
                                          f"{then} s; in the rendezvous alone "
                                          f"{s.get('agent_cpu_rendezvous_s')} s; whole life "
                                          f"{s.get('agent_cpu_life_s')} s (medians over reps)"))
                if s.get("worker_cpu_s") is not None or s.get("agent_cpu_ranked_to_workers_s") is not None:
                    # What each node spends once ranked, while the last nodes still wait for their rank: on
                    # one machine shared by N nodes the rendezvous' tail queues behind it.
                    spawn, worker = s.get("agent_cpu_ranked_to_workers_s"), s.get("worker_cpu_s")
                    rows.append(_row("P5", f"N={n} CPU s per node, ranked -> worker's first line", system,
                                     {"median": round((spawn or 0) + (worker or 0), 3), "n": 1},
                                     "s", note=(f"agent {spawn} s to start it, " if spawn is not None else "")
                                     + f"worker {worker} s to start (medians over reps)"))
                if s.get("agent_requests_per_node_per_round") is not None:
                    v = s["agent_requests_per_node_per_round"]
                    rows.append(_row("P5", f"N={n} etcd requests/node/round, whole job (agent count)", system,
                                     {"median": v, "n": 1}, ""))
                if s.get("server_requests_per_node") is not None:
                    v = s["server_requests_per_node"]
                    rows.append(_row("P5", f"N={n} etcd requests/node, launch -> workers (server count)",
                                     system, {"median": v, "n": 1}, ""))
    p6 = results.get("P6")
    if p6:
        for label, r in p6.get("commands", {}).items():
            system = "petctl" if "petctl" in label else "reference"
            rows.append(_row("P6", label, system, r.get("seconds"), "s", note=r.get("error", "")))
    rows.extend(store_rows(results.get("P7") or {}))
    rows.extend(snapshot_rows(results, _row))
    return rows


def store_rows(p7: dict[str, Any]) -> list[dict[str, Any]]:
    """P7's rows: per fault and system, restarts, steps lost, the longest pause, and two run counts."""
    rows: list[dict[str, Any]] = []
    check, end = p7.get("check_after_s"), p7.get("observed_s")
    for fid, res in (p7.get("faults") or {}).items():
        for system, s in res.get("summary", {}).items():
            n = s.get("runs", 0)
            errors = "; ".join(s.get("errors", []))
            rows.append(_row(fid, "restarts after the fault", system, s.get("restarts"), "",
                             note=f"{res.get('title')}" + (f"; errors: {errors}" if errors else "")))
            stopped = s.get("stopped_runs")
            rows.append(_row(fid, "steps lost", system, s.get("steps_lost"), "steps",
                             note=f"{stopped} run(s) stopped training and never resumed" if stopped else ""))
            rows.append(_row(fid, "longest pause in training", system, s.get("longest_pause_s"), "s",
                             note=f"window: the fault -> fault + {end:.0f} s" if end else ""))
            rows.append(_row(fid, f"runs training at world 3, fault + {check:.0f} s", system,
                             {"median": f"{s.get('training_runs')}/{n}", "n": n}))
            exits = s.get("exited_after_s") or {}
            died = (f"{exits['n']} node(s) exited at fault + {exits['min']:.1f} to {exits['max']:.1f} s: "
                    if exits.get("n") else "")
            rows.append(_row(fid, f"runs with every node process alive, fault + {end:.0f} s", system,
                             {"median": f"{s.get('all_alive_runs')}/{n}", "n": n},
                             note=died + " | ".join(s.get("last_errors", []))))
    return rows


def phase_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for sid in recovery_keys(results):
        res = results.get(sid)
        if not res:
            continue
        for system, s in res.get("summary", {}).items():
            sub = s.get("sub_phases_median") or {}
            if sub:
                slow = max(sub, key=lambda k: sub[k] or 0)
                out.append({"scenario": sid, "system": system, "sub_phases": sub, "phases": s.get(
                    "phases_median", {}), "slowest": slow})
    return out


def print_table(rows: list[dict[str, Any]], phase: list[dict[str, Any]]) -> None:
    headers = ["scen", "metric", "system", "min", "median", "max", "n", "goal", "÷ c10d", "÷ etcd-v2", "note"]
    body = [[r["scenario"], r["metric"], r["system"], _fmt(r["min"]), _fmt(r["median"]), _fmt(r["max"]),
             _fmt(r["n"]), r["goal"], r["ratios"].get("torchrun-c10d", ""),
             r["ratios"].get("torchrun-etcd-v2", ""), r["note"]] for r in rows]
    labels = phases.LABELS
    pbody = [[p["scenario"], p["system"], *[_fmt(p["sub_phases"].get(k)) for k in labels], p["slowest"]]
             for p in phase]
    try:
        from rich.console import Console
        from rich.table import Table

        console = Console(width=200)
        t = Table(title="petctl vs torchrun (seconds unless noted; ratio = petctl median / torchrun median)")
        for h in headers:
            t.add_column(h)
        for b in body:
            t.add_row(*[str(x) for x in b])
        console.print(t)
        if not pbody:
            return
        pt = Table(title="recovery phases (median seconds spent reaching each milestone after the previous)")
        for h in ["scen", "system", *labels, "slowest"]:
            pt.add_column(h)
        for b in pbody:
            pt.add_row(*[str(x) for x in b])
        console.print(pt)
    except ImportError:
        print(markdown_table(headers, body))
        if pbody:
            print(markdown_table(["scen", "system", *labels, "slowest"], pbody))


def markdown_table(headers: list[str], body: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in b) + " |" for b in body]
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], phase: list[dict[str, Any]]) -> str:
    headers = ["scenario", "metric", "system", "min", "median", "max", "goal", "petctl ÷ torchrun c10d",
               "petctl ÷ torchrun etcd-v2", "note"]
    body = [[r["scenario"], r["metric"], r["system"], _fmt(r["min"]), _fmt(r["median"]), _fmt(r["max"]),
             r["goal"], r["ratios"].get("torchrun-c10d", ""), r["ratios"].get("torchrun-etcd-v2", ""),
             r["note"]] for r in rows]
    labels = phases.LABELS
    pbody = [[p["scenario"], p["system"], *[_fmt(p["sub_phases"].get(k)) for k in labels], p["slowest"]]
             for p in phase]
    text = markdown_table(headers, body)
    if pbody:
        text += "\n\n" + markdown_table(["scenario", "system", *labels, "slowest"], pbody)
    return text


def chart(timeline: dict[str, Any], path: Path) -> str:
    """A PNG of the steps each node ran around the disruption; returns a note on what was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib, or petctl[bench])"
    if not timeline:
        return "no P1/P2 run in this benchmark: no chart"
    keys = sorted(timeline)
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.4 * len(keys)), squeeze=False, sharex=True)
    right = max((tl.get("seconds") or tl.get("capped") or 0) for tl in timeline.values()) + 1.5
    for ax, key in zip(axes[:, 0], keys, strict=True):
        tl = timeline[key]
        ax.set_xlim(-3, right)
        for node, pts in sorted(tl["series"].items()):
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, label=node)
        ax.axvline(0, color="red", lw=1)
        if tl.get("seconds") is None and tl.get("capped"):
            ax.axvspan(0, tl["capped"], color="red", alpha=0.06)
            ax.text(tl["capped"] / 2, ax.get_ylim()[1] / 2, "no step: survivors hung in a collective",
                    ha="center", fontsize=8, color="darkred")
        for label, t in (tl.get("milestones") or {}).items():
            if label in ("detect", "rendezvous", "workers_started", "model_ready", "first_step"):
                ax.axvline(t, color="grey", lw=0.6, ls="--")
                ax.text(t, ax.get_ylim()[1], label, rotation=90, fontsize=6, va="top", ha="right")
        done = (f"{tl['seconds']:.2f} s" if tl.get("seconds") is not None
                else f"> {tl.get('capped')} s (capped)")
        ax.set_title(f"{key}: training again after {done}", fontsize=9)
        ax.set_ylabel("step")
        ax.legend(fontsize=6, loc="lower right")
    axes[-1, 0].set_xlabel("seconds since the disruption (notice / SIGTERM / SIGSTOP)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart written to {path}"


def main(argv: list[str] | None = None) -> int:
    import json
    import sys

    args = argv if argv is not None else sys.argv[1:]
    path = Path(args[0] if args else "bench/results/latest.json")
    doc = json.loads(path.read_text())
    rows, phase = build_rows(doc["results"]), phase_rows(doc["results"])
    print_table(rows, phase)
    path.with_suffix(".md").write_text(markdown(rows, phase) + "\n")  # the table, as run.py writes it
    print(chart(doc.get("timeline") or {}, path.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
