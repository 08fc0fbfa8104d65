"""petctl's benchmark: recovery, scale-up, checkpoint and rendezvous figures side by side with torchrun.

    python bench/run.py [--reps 3] [--quick] [--out bench/results/latest.json] [--scenarios P1,P2,...]
    python bench/run.py --scenarios spot-10-15-notice,spot-10-15-mixed --systems petctl,torchrun-c10d \
        --boot 90,180 [--reps 1]

Runs every scenario on this machine (loopback only; every server binds 127.0.0.1 and is stopped at the
end), prints a table, writes JSON (with the commit, the dirty flag, the machine and its load, and the
command line: bench/runmeta.py) and a PNG timeline of a recovery next to the JSON. bench/README.md says
what each scenario measures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/run.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench import report, runmeta  # noqa: E402
from bench.scenarios.common import Context  # noqa: E402

ALL = ["P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8"]
SYSTEMS = ["petctl", "torchrun-c10d", "torchrun-etcd-v2"]


def _doc(args: argparse.Namespace, reps: int, scenarios: list[str], systems: list[str], started: float,
         results: dict[str, Any], ctx: Context, meta: dict[str, Any]) -> dict[str, Any]:
    return {**runmeta.finish(meta), "reps": reps, "quick": args.quick, "scenarios": scenarios,
            "systems": systems, "boots": args.boots, "wall_s": round(time.time() - started, 1),
            "results": results, "table": report.build_rows(results), "phases": report.phase_rows(results),
            "timeline": ctx.timeline}


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; `boots` (floats) from --boot, `reps` left None where not given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions per scenario (default 3; a trace scenario: 1)")
    parser.add_argument("--quick", action="store_true", help="1 repetition, smallest sizes (smoke test)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "latest.json"))
    parser.add_argument("--scenarios", default=",".join(ALL),
                        help="comma-separated subset of " + ",".join(ALL))
    from bench.scenarios.recovery import PETCTL_VARIANTS
    from bench.scenarios.rendezvous import STORES

    variants = [v for v in PETCTL_VARIANTS if v != "petctl"]
    stores = [v for v in STORES if v != "petctl"]
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"subset of {','.join(SYSTEMS)}, or a variant: {', '.join(variants)} (P1-P3), "
                             f"{', '.join(stores)} (P5: the v2 store)")
    parser.add_argument("--hang-cap", type=float, default=None,
                        help="P2: seconds torchrun is given before '> cap' (default 30, quick 20)")
    parser.add_argument("--grace", type=float, default=20.0, help="P1: notice -> SIGKILL seconds")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (node logs)")
    parser.add_argument("--workload", default="bench",
                        help="P1-P3: bench (workload.py), user (user_train.py, README-style), fsdp "
                             "(fsdp_train.py, the same with FSDP2), hf (examples/hf_trainer.py), lightning "
                             "(examples/lightning_ddp.py) or both (bench,user; comma-separated)")
    parser.add_argument("--boot", default="90",
                        help="trace scenarios: simulated seconds from a replacement's launch to its agent's "
                             "start, replayed compressed by the trace's time scale (90: 9 replayed s at "
                             "x10); comma-separated for one replay per boot (90,180). Default 90")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="trace scenarios: replay S simulated seconds per second, in place of the "
                             "trace's own (10 in the shipped traces). Every duration compresses by S: the "
                             "gaps, the notice windows and the boots; the agents' own start and a re-form "
                             "do not")
    parser.add_argument("--torchrun-every", type=int, default=None,
                        help="trace scenarios: torchrun's fixed durable interval in steps (default 1, the "
                             "best of a sweep over 1, 5 and 20)")
    parser.add_argument("--notice-at", choices=("settle", "burst"), default="settle",
                        help="P1: settle (after every warm pool is full) or burst (at a random time in the "
                             "first 30 s after the round formed: the second notice of a burst)")
    parser.add_argument("--seed", type=int, default=0, help="P1 --notice-at burst: the delays' seed")
    parser.add_argument("--sizes", default=None,
                        help="P5: comma-separated node counts (default 8,32,64; quick 8)")
    parser.add_argument("--p5-timeout", type=float, default=None,
                        help="P5: seconds a rep waits for every worker before it is a timeout (default 300 "
                             "for petctl, 420 for torchrun); a timeout skips the size's other reps")
    args = parser.parse_args(argv)
    try:
        args.boots = [float(x) for x in str(args.boot).split(",") if x.strip()]
    except ValueError:
        parser.error(f"--boot takes comma-separated seconds, not {args.boot!r}")
    if args.p5_timeout is not None and args.p5_timeout <= 0:
        parser.error("--p5-timeout must be > 0 seconds")
    if not args.boots or any(b < 0 for b in args.boots):
        parser.error("--boot: at least one boot time, each >= 0 seconds")
    if args.reps is not None and args.reps < 1:
        parser.error("--reps: at least 1")
    if args.time_scale is not None and args.time_scale <= 0:
        parser.error("--time-scale: simulated seconds per replayed second, more than 0")
    from bench.scenarios import spottrace  # a trace scenario: a shipped trace's name or a .json path

    traces = {s.strip(): spottrace.find(s.strip()) for s in args.scenarios.split(",") if s.strip()}
    args.traces = {k: v for k, v in traces.items() if v is not None}
    args.scenario_ids = [s.strip() if s.strip() in args.traces else s.strip().upper()
                         for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(args.scenario_ids) - set(ALL) - set(args.traces))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {ALL} or a trace in bench/traces/")
    args.parser = parser
    return args


def main(argv: list[str] | None = None) -> int:
    meta = runmeta.start(argv if argv is None else ["bench/run.py", *argv])
    args = parse(argv)
    parser = args.parser
    # A SIGTERM (`kill`, a timeout) unwinds like Ctrl-C: every `finally` runs, so the jobs' agents, their
    # workers and the etcd stop with the bench. Without it a killed run left three nodes training for 40
    # minutes (their own sessions), loading every later run on the machine.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    from bench.scenarios import spottrace

    traces, scenarios = args.traces, args.scenario_ids
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    workloads = ["bench", "user"] if workloads == ["both"] else workloads
    if not workloads or set(workloads) - {"bench", "user", "fsdp", "hf", "lightning"}:
        parser.error(f"--workload: choose bench, user, fsdp, hf, lightning or both, not {args.workload!r}")
    if args.torchrun_every is not None and args.torchrun_every < 1:
        parser.error("--torchrun-every: a number of steps, at least 1")
    reps = 1 if args.quick else (args.reps or 3)
    trace_reps = 1 if args.quick else (args.reps or 1)
    default_sizes = [8] if args.quick else [8, 32, 64]
    try:
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else default_sizes
    except ValueError:
        parser.error(f"--sizes takes comma-separated integers, not {args.sizes!r}")
    if any(n < 1 for n in sizes):
        parser.error("--sizes: every node count must be at least 1")
    out_path = Path(args.out).resolve()
    scratch = Path(tempfile.mkdtemp(prefix="petctl-bench-"))

    from petctl.io.etcd import EtcdServer
    from petctl.providers.local.metadata_server import LocalMetadataServer

    etcd = imds = None
    started = time.time()
    results: dict[str, Any] = {}
    try:
        needs_servers = bool(traces) or any(s in scenarios for s in ("P1", "P2", "P3", "P5"))
        if needs_servers:
            etcd = EtcdServer.start(scratch / "etcd", log_path=scratch / "etcd.log")
            imds = LocalMetadataServer(scratch / "notices").start()
        ctx = Context(root=scratch, reps=reps, quick=args.quick, etcd=etcd, imds=imds, systems=systems,
                      hang_cap=args.hang_cap or (20.0 if args.quick else 30.0), grace=args.grace, sizes=sizes,
                      workloads=workloads, notice_at=args.notice_at, seed=args.seed,
                      p5_timeout=args.p5_timeout)
        if "P5" in scenarios:  # start-up is in its figures: start nodes as an instance's install does
            ctx.python = runmeta.installed_python(scratch / "python")
        ctx.log(f"scratch dir {scratch}; scenarios {scenarios}; reps {reps}")
        for sid in scenarios:
            t0 = time.time()
            if sid in traces:  # issues 28, 43: the same trace under petctl and torchrun, once per boot
                for boot in args.boots:
                    key = sid if len(args.boots) == 1 else f"{sid}-boot{boot:g}"
                    t_b = time.time()
                    every = args.torchrun_every or spottrace.TORCHRUN_EVERY
                    results[key] = spottrace.run(ctx, traces[sid], systems, boot_s=boot, reps=trace_reps,
                                                 torchrun_every=every, time_scale=args.time_scale)
                    results[key]["wall_s"] = round(time.time() - t_b, 1)
                    _write(out_path, _doc(args, reps, scenarios, systems, started, results, ctx, meta))
                    text = spottrace.table(results[key])
                    out_path.with_name(f"{out_path.stem}-{key}.md").write_text(text + "\n")
                    print(text)
                    print(spottrace.chart(results[key], out_path.with_name(f"{out_path.stem}-{key}.png")))
                continue
            if sid in ("P1", "P2", "P3"):
                from bench.scenarios import recovery

                for workload in workloads:
                    key = recovery.result_key(sid, workload, ctx.notice_at)
                    t_w = time.time()
                    results[key] = recovery.run(ctx, sid, workload)
                    results[key]["wall_s"] = round(time.time() - t_w, 1)
                    # partial
                    _write(out_path, _doc(args, reps, scenarios, systems, started, results, ctx, meta))
                continue
            elif sid == "P4":
                from bench.scenarios import checkpoint

                results[sid] = checkpoint.run(ctx)
            elif sid == "P5":
                from bench.scenarios import rendezvous

                results[sid] = rendezvous.run(ctx)
            elif sid == "P6":
                from bench.scenarios import cli

                results[sid] = cli.run(ctx)
            elif sid == "P8":
                from bench.scenarios import snapshots

                results[sid] = snapshots.run(ctx)
            elif sid == "P7":  # every run starts an etcd of its own, to fail it
                from bench.scenarios import storefaults

                results[sid] = storefaults.run(ctx)
            results[sid]["wall_s"] = round(time.time() - t0, 1)
            _write(out_path, _doc(args, reps, scenarios, systems, started, results, ctx, meta))  # partial
    except BaseException:  # interrupted (Ctrl-C, SIGTERM) or failed: what was measured is in the JSON
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        if imds is not None:
            imds.stop()
        if etcd is not None:
            etcd.stop(remove_data=True)

    doc = _doc(args, reps, scenarios, systems, started, results, ctx, meta)
    _write(out_path, doc)
    rows, phase = doc["table"], doc["phases"]
    report.print_table(rows, phase)
    note = report.chart(ctx.timeline, out_path.with_suffix(".png"))
    (out_path.with_suffix(".md")).write_text(report.markdown(rows, phase) + "\n")
    print(f"results written to {out_path} (+ .md); {note}")
    failed = run_errors(results)
    if args.keep:
        print(f"node logs kept in {scratch}")
    elif failed:  # the logs are the only record of why: keep them, whatever --keep says
        print(f"{len(failed)} run(s) failed ({failed[0]}); node logs kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def run_errors(results: Any) -> list[str]:
    """Every `error` a run recorded anywhere in `results` (a scenario's runs, a trace's systems), in
    order. Why: a failed run's node logs are the only record of its cause, and the scratch dir that holds
    them is removed after a run without `--keep`; torchrun's P5 rep that timed out at 64 nodes left no
    trace of why."""
    found: list[str] = []
    if isinstance(results, dict):
        if isinstance(results.get("error"), str):
            found.append(results["error"])
        for key, value in results.items():
            if key != "error":
                found += run_errors(value)
    elif isinstance(results, list):
        for value in results:
            found += run_errors(value)
    return found


if __name__ == "__main__":
    sys.exit(main())
