"""A spot notice's hand-off on the local provider, measured as a user runs it: `python bench/handoff.py`.

Per repetition: `petctl setup`, a 3-node job of the README-style script (bench/user_train.py, at its max
of 3, so a replacement cannot join beside the noticed node), trained a while, then
`petctl chaos --notice --grace G` on the node of rank 2. Each replacement is launched at once and boots
`--replace-delay` seconds (the simulated boot) before its agent starts. Read back from the job's own logs:

- notice -> replacement launched: from the noticed agent's `preemption.notice` (when it learned of it) to
  the reconciler's `instance.launched` that replaces it;
- why and when it handed off (`preemption.handoff`: `replacement` or `deadline`);
- the hand-off's stall: rank 0's last step before the re-form to its first step after it;
- the world sizes rank 0 trained at after the notice, and the steps it ran twice (redone);
- the noticed node's last step -> its leave, beside its ranks' save;
- the noticed instance billed from its launch to its end (`instances.json`), beside the notice's reclaim.

`--boot 8` has the replacement up before the window closes (one re-form at full size); `--boot 40` has it
later than the window (world 3, then 2 until it joins, then 3). The figures leave out what a real cloud
adds: the boot is a sleep, not an AMI, and 3 agents share 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench import runmeta  # noqa: E402
from bench.procs import wait_for  # noqa: E402
from petctl.core.eventlog import parse_line  # noqa: E402

FAST = ["--timeout", "heartbeat_ttl=2", "--timeout", "last_call=0.5", "--timeout", "stop_grace=2",
        "--timeout", "imds_interval=0.5"]


class Cli:
    """`python -m petctl` with its own PETCTL_HOME."""

    def __init__(self, home: Path) -> None:
        self.home = home
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PETCTL_HOME": str(home), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}

    def run(self, *args: str, timeout: float = 180) -> str:
        proc = subprocess.run([sys.executable, "-m", "petctl", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"petctl {' '.join(args)}: {proc.stderr.strip()[-500:]}")
        return proc.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json"))

    def job_dir(self, job: str) -> Path:
        return self.home / "local" / "jobs" / job

    def node_events(self, job: str) -> list[dict[str, Any]]:
        out = []
        for log in sorted(self.job_dir(job).glob("instances/*/agent.log")):
            for line in log.read_text(errors="replace").splitlines():
                record = parse_line(line)
                if record is not None:
                    out.append({**record, "node": log.parent.name})
        return sorted(out, key=lambda r: r["ts"])


def wait(predicate, timeout: float, what: str) -> Any:
    """`bench.procs.wait_for`, which raises when the wait runs out (a repetition then records why)."""
    value = wait_for(predicate, timeout, 0.3)
    if not value:
        raise TimeoutError(f"no {what} within {timeout:.0f}s")
    return value


def one(cli: Cli, job: str, boot: float, grace: float, steps_after: int) -> dict[str, Any]:
    cli.run("run_job", "--name", job, "--min", "2", "--max", "3", "--size", "3", "--replace-delay", str(boot),
            *FAST, "--wait", "--wait-timeout", "180", str(BENCH / "user_train.py"), "--",
            "--ckpt-every", "20", "--step-time", "0.1")

    def rank0_steps() -> list[dict[str, Any]]:
        return [e for e in cli.node_events(job) if e["event"] == "train.step" and e.get("rank") == 0]

    wait(lambda: len(rank0_steps()) >= 40, 120, "40 steps")
    wait(lambda: any((n.get("last_checkpoint") or {}).get("save_s") is not None
                     for n in cli.json("status", job)["nodes"].values()), 60, "rank 0's save time published")
    ranks = cli.json("status", job)["ranks"]
    victim = next(node for node, rank in ranks.items() if rank == 2)
    cli.run("chaos", job, "--node", victim, "--notice", "--grace", str(grace))
    reclaim_at = json.loads((cli.job_dir(job) / "notices" / f"{victim}.json").read_text())["time"]
    timeline = lambda: cli.json("events", job, "--all")  # noqa: E731
    launched = wait(lambda: [e for e in timeline() if e["event"] == "instance.launched"
                             and e.get("replaces") == victim], 20, "the replacement launched")[0]
    replacement = launched["instance"]
    wait(lambda: sum(1 for e in rank0_steps() if e["ts"] > reclaim_at) >= steps_after
         and any(e["node"] == replacement for e in cli.node_events(job) if e["event"] == "train.step"),
         grace + boot + 120, "training with the replacement")
    events = cli.node_events(job)
    cli.run("kill_job", job)

    seen = next(e["ts"] for e in events if e["event"] == "preemption.notice" and e["node"] == victim)
    handoff = next(e for e in events if e["event"] == "preemption.handoff" and e["node"] == victim)
    left = next(e["ts"] for e in events if e["event"] == "agent.left" and e["node"] == victim)
    steps = [e for e in events if e["event"] == "train.step" and e.get("rank") == 0]
    after = [e for e in steps if e["ts"] >= seen]
    # The hand-off's stall: rank 0's last step before the re-form that followed the hand-off, to the next.
    gaps = [(b["ts"] - a["ts"], a, b) for a, b in zip(steps, steps[1:], strict=False)
            if a["ts"] >= handoff["ts"]]
    stall, before, resumed = max(gaps[:30], key=lambda g: g[0]) if gaps else (None, None, None)
    ran: dict[int, int] = {}
    for e in steps:
        ran[e["step"]] = ran.get(e["step"], 0) + 1
    victim_steps = [e["ts"] for e in events if e["event"] == "train.step" and e["node"] == victim]
    rows = {r["id"]: r for r in json.loads((cli.job_dir(job) / "instances.json").read_text())}
    billed = rows[victim]
    ended = billed.get("ended_at")
    return {
        "victim": victim, "replacement": replacement, "boot_s": boot, "grace_s": grace,
        "notice_to_launch_s": round(launched["ts"] - seen, 3),
        "handoff_why": handoff["why"], "notice_to_handoff_s": round(handoff["ts"] - seen, 3),
        "handoff_stall_s": round(stall, 3) if stall is not None else None,
        "stall_from_step": before["step"] if before else None,
        "stall_to_step": resumed["step"] if resumed else None,
        "worlds_after_notice": sorted({e["world_size"] for e in after}),
        "steps_redone": sum(n - 1 for n in ran.values()),
        "last_step_to_leave_s": round(left - max(victim_steps), 3) if victim_steps else None,
        "victim_billed_s": round(ended - billed["launched_at"], 3) if ended else None,
        "victim_ended_before_reclaim_s": round(reclaim_at - ended, 3) if ended else None,
        "victim_end_reason": billed.get("reason"),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        return round(statistics.median(values), 3) if values else None

    keys = ("notice_to_launch_s", "notice_to_handoff_s", "handoff_stall_s", "last_step_to_leave_s",
            "victim_ended_before_reclaim_s")
    return {"reps": len(runs), **{k: med(k) for k in keys},
            "max_handoff_stall_s": max((r["handoff_stall_s"] for r in runs if r.get("handoff_stall_s")),
                                       default=None),
            "steps_redone": sum(r["steps_redone"] for r in runs),
            "why": sorted({r["handoff_why"] for r in runs}),
            "worlds_after_notice": sorted({w for r in runs for w in r["worlds_after_notice"]})}


def table(doc: dict[str, Any]) -> str:
    lines = ["| boot | reps | hand-off | notice -> replacement launched | notice -> hand-off "
             "| hand-off stall (median, max) | worlds after the notice | steps redone "
             "| noticed node: last step -> left | ended before its reclaim |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for boot, s in doc["summary"].items():
        lines.append(f"| {boot} s | {s['reps']} | {', '.join(s['why'])} | {s['notice_to_launch_s']} s | "
                     f"{s['notice_to_handoff_s']} s | {s['handoff_stall_s']} s, "
                     f"{s['max_handoff_stall_s']} s | "
                     f"{s['worlds_after_notice']} | {s['steps_redone']} | {s['last_step_to_leave_s']} s | "
                     f"{s['victim_ended_before_reclaim_s']} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--boot", default="8,40", help="replacement boot(s), seconds, comma-separated")
    parser.add_argument("--grace", type=float, default=30.0, help="the notice's seconds to the reclaim")
    parser.add_argument("--steps-after", type=int, default=20, help="rank 0's steps after the reclaim time")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "handoff.json")
    args = parser.parse_args(argv)
    meta = runmeta.start()
    doc: dict[str, Any] = {"runs": {}, "summary": {}}
    for boot in [float(b) for b in args.boot.split(",")]:
        runs = []
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory(prefix="petctl-handoff-") as tmp:
                cli = Cli(Path(tmp) / "home")
                cli.run("setup")
                try:
                    runs.append(one(cli, f"h{int(boot)}r{rep}", boot, args.grace, args.steps_after))
                    print(json.dumps(runs[-1]), flush=True)
                except (RuntimeError, TimeoutError, StopIteration) as e:
                    runs.append({"error": f"{type(e).__name__}: {e}"})
                    print(f"rep {rep} at boot {boot}: {e}", flush=True)
                finally:
                    subprocess.run([sys.executable, "-m", "petctl", "teardown", "--force"], env=cli.env,
                                   capture_output=True, timeout=120)
        doc["runs"][f"{boot:g}"] = runs
        doc["summary"][f"{boot:g}"] = summarize([r for r in runs if "error" not in r])
    doc = {**runmeta.finish(meta), **doc}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    md = table(doc)
    head = f"`{doc.get('command')}` at {doc.get('commit')} (dirty: {doc.get('dirty')})"
    args.out.with_suffix(".md").write_text(f"# A spot notice's hand-off, local provider\n\n{head}\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
