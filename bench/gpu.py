"""The figures only a GPU can give, in one command (issue 29): P8 and P4 on the device, warm start.

    python bench/gpu.py                                   # on a GPU: 1, 4 and 16 GB, under 10 minutes
    python bench/gpu.py --device cpu --sizes-gb 0.004 --steps 24 --block 4 --step-ms 20   # the CPU smoke

Parts, in order, each skipped with its reason when it cannot run here or would not fit the time left:
- the device-to-host copy per GB, pageable and pinned, and whether a copy overlaps a step (`gpu_step`);
- warm start: launch -> first step, cold and warm workers, and a world-1 re-form (`gpu_warm`);
- for each state size (a model + AdamW state of that many GB, sizes capped by free device memory, a
  step of real matmuls padded to --step-ms): P8, the in-memory snapshot tier at its defaults
  (`gpu_snap`), then P4, `Checkpointer`'s background save to a local directory and to moto_server
  (`gpu_save`);
- P8 again at the smallest size with the copy straight into pageable memory (what pinning buys).
Writes JSON (default bench/results/gpu-<device>.json) and the same table as Markdown beside it; prints
the table, the device, driver, CUDA and torch versions first. Exit 1 when a part failed (its error is in
the JSON and the table), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

T_START = time.time()  # before the torch import: the ten minutes include it
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import gpu_save, gpu_snap, gpu_step, gpu_warm, runmeta  # noqa: E402
from bench.gpu_info import device_info  # noqa: E402
from bench.gpu_step import Skip  # noqa: E402
from bench.gpu_table import markdown, rows  # noqa: E402

GB = 1e9
SAVE_RATES = {"file": 0.3e9, "s3": 0.05e9}  # bytes/s assumed for a target before a save measures it


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes-gb", default="1,4,16", help="state sizes (model + AdamW state), comma-separated")
    p.add_argument("--step-ms", type=float, default=100.0, help="the training step's target time")
    p.add_argument("--steps", type=int, default=0, help="P8 steps per size (0: --p8-seconds' worth)")
    p.add_argument("--p8-seconds", type=float, default=20.0)
    p.add_argument("--block", type=int, default=10, help="P8 steps per block (with / without snapshots)")
    p.add_argument("--saves", type=int, default=2, help="P4 saves per size and target")
    p.add_argument("--s3-max-gb", type=float, default=4.0,
                   help="largest state saved to the S3 emulator (moto keeps it all, slowly)")
    p.add_argument("--copy-gb", type=float, default=1.0, help="bytes of the copy and overlap tests (capped)")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting parts after this long")
    p.add_argument("--hard-limit-s", type=float, default=585.0,
                   help="write what is measured and exit 3 after this long, whatever is running")
    p.add_argument("--worker-timeout-s", type=float, default=120.0)
    p.add_argument("--scratch", default=tempfile.gettempdir(), help="where P4's checkpoints go")
    p.add_argument("--out", default="", help="JSON path (default bench/results/gpu-<device>.json)")
    args = p.parse_args(argv)
    try:
        args.sizes = sorted(float(x) for x in args.sizes_gb.split(",") if x.strip())
    except ValueError:
        p.error(f"--sizes-gb: not a list of numbers: {args.sizes_gb!r}")
    if not args.sizes or min(args.sizes) <= 0:
        p.error("--sizes-gb: give at least one size, each > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here (use --device cpu)")
    if args.step_ms <= 0 or args.block < 2 or args.saves < 1 or args.budget_s <= 0:
        p.error("--step-ms and --budget-s must be > 0, --block >= 2, --saves >= 1")
    return args


class Run:
    """The document being built, the deadline, and one place where a part's outcome is recorded."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = T_START + args.budget_s  # start-up (the torch import) included
        self.device = gpu_step.Device(args.device)
        self.rates = dict(SAVE_RATES)  # bytes/s of the slowest save seen per target, for estimates
        self.meta = runmeta.start()
        self.doc: dict[str, Any] = {
            **self.meta, "started": T_START,
            "device": device_info(args.device), "config": {k: v for k, v in vars(args).items()},
            "errors": []}

    def left(self) -> float:
        return self.deadline - time.time()

    def part(self, name: str, fn: Any, *a: Any) -> dict[str, Any]:
        """fn(*a); {"skipped": why} when it raised Skip; {"error": ...} when it raised anything else
        (`problems` lists it in `errors`)."""
        t0 = time.monotonic()
        print(f"gpu-bench: {name} ({self.left():.0f} s left)", file=sys.stderr, flush=True)
        try:
            result = fn(*a)
        except Skip as e:
            result = {"skipped": str(e)}
        except Exception as e:  # noqa: BLE001 - one part's failure must not cost the others' figures
            result = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"gpu-bench: {name} failed: {result['error']}", file=sys.stderr, flush=True)
        result.setdefault("seconds", round(time.monotonic() - t0, 2))
        return result

    def fit(self, estimate: float, what: str) -> None:
        """Raises Skip when `estimate` seconds do not fit the time left."""
        if self.left() < estimate:
            raise Skip(f"over the time budget: {what} needs about {estimate:.0f} s, {self.left():.0f} s left")


def build(run: Run, gb: float) -> gpu_step.StepModel:
    """The model of a `gb` state on the device. Raises Skip when it does not fit its memory."""
    need = 2.2 * gb * GB + (1 << 30 if run.device.cuda else 0)  # weights, grads, AdamW's state, temporaries
    free = run.device.free_bytes()
    if free < need:
        where = "device" if run.device.cuda else "host"
        raise Skip(f"{where} memory: {free / GB:.1f} GB free, the model, its gradients and AdamW need "
                   f"{need / GB:.1f} GB")
    return gpu_step.StepModel(run.device, gb * GB, run.args.step_ms / 1e3)


def p8(run: Run, gb: float, first: bool) -> dict[str, Any]:
    """P8 on a model of `gb` (and at the first size, P8 with the copy unpinned too)."""
    args, device = run.args, run.device
    step_s = args.step_ms / 1e3
    steps = args.steps or max(4 * args.block, int(args.p8_seconds / step_s))
    run.fit(steps * step_s * (2 if first else 1) + 2 * gb + 10, f"P8 at {gb} GB")
    model = build(run, gb)
    try:
        directory, note = gpu_snap.snapshot_dir(model.state_bytes(), Path(args.scratch))
        out: dict[str, Any] = {"model": model.describe(), "snapshot_dir": str(directory), "dir_note": note}
        out["p8"] = run.part(f"P8 {gb} GB", gpu_snap.run, device, model, directory, steps, args.block)
        if first:
            out["exact"] = run.part(f"P8 {gb} GB exact", gpu_snap.exact, device, model, directory)
            out["p8_unpinned"] = run.part(f"P8 {gb} GB unpinned", gpu_snap.run, device, model, directory,
                                          steps, args.block, False)
        return out
    finally:
        del model
        device.release()


def p4(run: Run, gb: float) -> dict[str, Any]:
    """P4 to a directory and to the S3 emulator on a model of `gb`."""
    run.fit(gb * GB / run.rates["file"] + 2 * gb + 10, f"P4 at {gb} GB")
    model = build(run, gb)
    try:
        return {"model": model.describe(),
                "p4_file": run.part(f"P4 {gb} GB file", save, run, model, gb, "file"),
                "p4_s3": run.part(f"P4 {gb} GB s3", save, run, model, gb, "s3")}
    finally:
        del model
        run.device.release()


def save(run: Run, model: gpu_step.StepModel, gb: float, target: str) -> dict[str, Any]:
    args = run.args
    if target == "s3" and gb > args.s3_max_gb:
        raise Skip(f"over --s3-max-gb {args.s3_max_gb} (the emulator keeps every byte, slowly)")
    if target == "s3" and importlib.util.find_spec("moto") is None:
        raise Skip("moto is not installed in this Python: the S3 emulator part needs"
                   " `pip install 'moto[server]'`")
    run.fit(gb * GB / run.rates[target] + 10, f"a {target} save of {gb} GB")
    scratch = Path(tempfile.mkdtemp(prefix="petctl-gpubench-p4-", dir=args.scratch))
    try:
        free = shutil.disk_usage(scratch).free
        if free < 2.5 * gb * GB:
            raise Skip(f"{args.scratch}: {free / GB:.1f} GB free, {2.5 * gb:.1f} GB needed")
        rest = (scratch / "cache", args.saves, run.deadline - 20)
        if target == "file":
            out = gpu_save.run(model, (scratch / "store").as_uri(), *rest)
        else:
            with gpu_save.MotoServer(scratch) as moto, _environ(gpu_save.s3_env(moto.url)):
                out = gpu_save.run(model, f"s3://{gpu_save.BUCKET}/p4-{gb}", *rest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rates = [s["gb_per_s"] * GB for s in out["saves"] if s.get("gb_per_s")]
    if rates:
        run.rates[target] = min(rates)
    return out


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Any:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = Run(args)
    device, doc = run.device, run.doc
    out = Path(args.out or REPO / "bench" / "results" / f"gpu-{_slug(doc['device']['name'])}.json")
    watchdog = threading.Timer(max(1.0, T_START + args.hard_limit_s - time.time()), _give_up, (run, out))
    watchdog.daemon = True
    watchdog.start()
    small = min(args.sizes)
    copy_bytes = int(min(args.copy_gb, small) * GB)
    doc["copy"] = run.part("copy", gpu_step.copy_rates, device, copy_bytes)
    doc["overlap"] = run.part("overlap", overlaps, run, copy_bytes)
    doc["warm"] = run.part("warm", gpu_warm.run, args.device, args.worker_timeout_s, run.deadline - 20)
    # P8 at every size first (the headline), then P4: the models are made again for it
    # each size joins the document once its P8 is done, so the watchdog writes every finished part
    doc["sizes"] = []
    for i, gb in enumerate(args.sizes):
        doc["sizes"].append({"state_gb": gb, "snap": run.part(f"P8 at {gb} GB", p8, run, gb, i == 0)})
    for size in doc["sizes"]:
        size["save"] = run.part(f"P4 at {size['state_gb']} GB", p4, run, size["state_gb"])
    watchdog.cancel()
    doc["errors"] = problems(doc)
    write(doc, out)
    return 1 if doc["errors"] else 0


def problems(doc: Any, path: str = "") -> list[str]:
    """Every failure in the document, where it is: a part's or a worker's error, a save's, a check that
    did not hold (`verified` false), and a snapshot writer that disabled itself (the first H100 run's
    P8 rows were one snapshot's figures, the writer off after it, and nothing said so)."""
    found: list[str] = []
    if isinstance(doc, dict):
        if isinstance(doc.get("error"), str):
            found.append(f"{path or 'run'}: {doc['error']}")
        if doc.get("verified") is False:
            found.append(f"{path}: not verified")
        if isinstance(doc.get("disabled"), str):  # a writer that turned itself off measured nothing after
            found.append(f"{path}: snapshots disabled: {doc['disabled']}")
        for key, value in doc.items():
            if key not in ("error", "errors", "config", "table"):
                found += problems(value, f"{path}.{key}" if path else str(key))
        found += [f"{path}.errors: {e}" for e in doc.get("errors") or [] if path]
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += problems(value, f"{path}[{i}]")
    return found


def write(doc: dict[str, Any], out: Path) -> None:
    """The JSON, the table as Markdown beside it, and the table on stdout."""
    doc["seconds"] = round(time.time() - T_START, 1)
    if "machine" in doc:  # the load average at this write (the end)
        doc.update(runmeta.finish({"machine": doc["machine"]}))
    doc["table"] = rows(doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    text = markdown(doc)
    out.with_suffix(".md").write_text(text)
    print(text, flush=True)
    print(f"gpu-bench: {doc['seconds']} s; JSON {out}", flush=True)


def _give_up(run: Run, out: Path) -> None:
    """The watchdog: past --hard-limit-s, write what was measured (a part in flight is missing) and exit
    at once; the children die with this process (`die_with_parent`)."""
    try:
        doc = json.loads(json.dumps(run.doc, default=str))  # a copy: the main thread still writes
        doc["errors"] = [f"watchdog: still running after {run.args.hard_limit_s} s; parts not done are "
                         "missing", *problems(doc)]
        write(doc, out)
    finally:
        os._exit(3)


def overlaps(run: Run, nbytes: int) -> dict[str, Any]:
    """The overlap test with a pinned copy and a pageable one (pageable only on CPU)."""
    probe = gpu_step.StepModel(run.device, min(min(run.args.sizes), 0.05) * GB, run.args.step_ms / 1e3)
    kinds = ("pinned", "pageable") if run.device.cuda else ("pageable",)
    return {kind: gpu_step.overlap(run.device, probe, nbytes, kind == "pinned") for kind in kinds}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "device"


if __name__ == "__main__":
    raise SystemExit(main())
