"""petctl's benchmark: recovery, scale-up, checkpoint and rendezvous figures side by side with torchrun.

    python bench/run.py [--reps 3] [--quick] [--out bench/results/latest.json] [--scenarios P1,P2,...]

Runs every scenario on this machine (loopback only; every server binds 127.0.0.1 and is stopped at the
end), prints a table, writes JSON (with the machine it ran on) and a PNG timeline of a recovery next to
the JSON. bench/README.md says what each scenario measures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
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

from bench import report  # noqa: E402
from bench.scenarios.common import Context  # noqa: E402

ALL = ["P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8"]
SYSTEMS = ["petctl", "torchrun-c10d", "torchrun-etcd-v2"]


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            total_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
            mem_gib = round(total_kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpu_count": os.cpu_count(), "cpu_model": model, "mem_gib": mem_gib,
            "load_avg_at_write": list(os.getloadavg()), "python": platform.python_version(),
            "torch": torch_version, "platform": platform.platform(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def _doc(args: argparse.Namespace, reps: int, scenarios: list[str], systems: list[str], started: float,
         results: dict[str, Any], ctx: Context) -> dict[str, Any]:
    return {"machine": machine_info(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "reps": reps, "quick": args.quick, "scenarios": scenarios, "systems": systems,
            "wall_s": round(time.time() - started, 1), "results": results,
            "table": report.build_rows(results), "phases": report.phase_rows(results),
            "timeline": ctx.timeline}


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions per scenario (default 3)")
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
    parser.add_argument("--boot", type=float, default=3.0,
                        help="trace scenarios: seconds from a replacement's launch to its agent's start")
    parser.add_argument("--torchrun-every", type=int, default=None,
                        help="trace scenarios: torchrun's fixed durable interval in steps (default 1, the "
                             "best of a sweep over 1, 5 and 20)")
    parser.add_argument("--notice-at", choices=("settle", "burst"), default="settle",
                        help="P1: settle (after every warm pool is full) or burst (at a random time in the "
                             "first 30 s after the round formed: the second notice of a burst)")
    parser.add_argument("--seed", type=int, default=0, help="P1 --notice-at burst: the delays' seed")
    parser.add_argument("--sizes", default=None,
                        help="P5: comma-separated node counts (default 8,32,64; quick 8)")
    args = parser.parse_args(argv)
    # A SIGTERM (`kill`, a timeout) unwinds like Ctrl-C: every `finally` runs, so the jobs' agents, their
    # workers and the etcd stop with the bench. Without it a killed run left three nodes training for 40
    # minutes (their own sessions), loading every later run on the machine.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    from bench.scenarios import spottrace  # a trace scenario: a shipped trace's name or a .json path

    traces = {s.strip(): spottrace.find(s.strip()) for s in args.scenarios.split(",") if s.strip()}
    traces = {k: v for k, v in traces.items() if v is not None}
    scenarios = [s.strip() if s.strip() in traces else s.strip().upper()
                 for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(ALL) - set(traces))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {ALL} or a trace in bench/traces/")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    workloads = ["bench", "user"] if workloads == ["both"] else workloads
    if not workloads or set(workloads) - {"bench", "user", "fsdp", "hf", "lightning"}:
        parser.error(f"--workload: choose bench, user, fsdp, hf, lightning or both, not {args.workload!r}")
    if args.torchrun_every is not None and args.torchrun_every < 1:
        parser.error("--torchrun-every: a number of steps, at least 1")
    reps = 1 if args.quick else max(1, args.reps)
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
                      workloads=workloads, notice_at=args.notice_at, seed=args.seed)
        ctx.log(f"scratch dir {scratch}; scenarios {scenarios}; reps {reps}")
        for sid in scenarios:
            t0 = time.time()
            if sid in traces:  # issue 28: the same trace under petctl and torchrun (its own table and PNG)
                results[sid] = spottrace.run(ctx, traces[sid], systems, boot_s=args.boot,
                                             torchrun_every=args.torchrun_every or spottrace.TORCHRUN_EVERY)
                results[sid]["wall_s"] = round(time.time() - t0, 1)
                _write(out_path, _doc(args, reps, scenarios, systems, started, results, ctx))
                text = spottrace.table(results[sid])
                out_path.with_name(f"{out_path.stem}-{sid}.md").write_text(text + "\n")
                print(text)
                print(spottrace.chart(results[sid], out_path.with_name(f"{out_path.stem}-{sid}.png")))
                continue
            if sid in ("P1", "P2", "P3"):
                from bench.scenarios import recovery

                for workload in workloads:
                    key = recovery.result_key(sid, workload, ctx.notice_at)
                    t_w = time.time()
                    results[key] = recovery.run(ctx, sid, workload)
                    results[key]["wall_s"] = round(time.time() - t_w, 1)
                    _write(out_path, _doc(args, reps, scenarios, systems, started, results, ctx))  # partial
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
            _write(out_path, _doc(args, reps, scenarios, systems, started, results, ctx))  # partial
    except BaseException:  # interrupted (Ctrl-C, SIGTERM) or failed: what was measured is in the JSON
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        if imds is not None:
            imds.stop()
        if etcd is not None:
            etcd.stop(remove_data=True)

    doc = _doc(args, reps, scenarios, systems, started, results, ctx)
    _write(out_path, doc)
    rows, phase = doc["table"], doc["phases"]
    report.print_table(rows, phase)
    note = report.chart(ctx.timeline, out_path.with_suffix(".png"))
    (out_path.with_suffix(".md")).write_text(report.markdown(rows, phase) + "\n")
    print(f"results written to {out_path} (+ .md); {note}")
    if args.keep:
        print(f"node logs kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
