"""The local demo: an elastic PyTorch job on this machine that loses nodes and gains one, by itself.

    python examples/demo.py [--keep]

It drives the `petctl` command line exactly as you would (each step is printed as the command it runs),
in a private PETCTL_HOME so it touches nothing of yours:

  1. `petctl setup` (an embedded etcd on 127.0.0.1), then a 2-node job (min 1, max 3) training
     examples/train_ddp.py with gloo on CPU;
  2. kills one node (SIGKILL of its process group): the survivor re-forms alone and resumes from the
     last checkpoint, then the reconciler's replacement joins and the world is 2 again;
  3. scales the job to 3 nodes;
  4. sends a spot interruption notice to one node: it leaves gracefully before it is reclaimed, and
     the job trains on with 2 (its replacement joins if it starts before the job ends);
  5. lets the job finish, prints a summary and tears everything down.

It exits non-zero if the job did not behave (did not shrink, grow, resume, or succeed). Then, as with
--keep, it stops the job but keeps etcd and every log, and prints how to read them and tear down.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = "demo"
# Long enough that the scale-up and the notice come while it trains. Training keeps its pace on a loaded
# machine (0.05 s a step, about 20 steps a second) while instances start more slowly. Under two busy
# loops beside a test run, each new instance took 10-20 s to join, and the kill's replacement joined by
# step 456. The scale-up then needs one more start (up to 400 steps), and the notice a re-form (about
# 100). So the scale-up goes before the notice, with SCALE_ROOM steps left for both.
STEPS = 1200
SCALE_ROOM = 600  # steps left at the scale-up: an instance starts and joins, then the notice's re-form


@dataclass
class Demo:
    home: Path
    started: float = field(default_factory=time.monotonic)
    worlds: list[int] = field(default_factory=list)  # world sizes seen, in order, without repeats
    rounds: set[int] = field(default_factory=set)
    first_step_s: float = 0.0  # launch -> first training step

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PETCTL_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def petctl(self, *args: str, quiet: bool = False) -> str:
        if not quiet:
            self.say("$ petctl " + " ".join(args))
        proc = subprocess.run([sys.executable, "-m", "petctl", *args], env=self.env, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise SystemExit(f"petctl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        if not quiet and proc.stdout.strip():
            print("    " + proc.stdout.strip().replace("\n", "\n    "), flush=True)
        return proc.stdout

    def status(self) -> dict[str, Any]:
        status = json.loads(self.petctl("status", JOB, "-o", "json", quiet=True))
        if status["ranks"]:
            if not self.worlds or self.worlds[-1] != status["world_size"]:
                self.worlds.append(status["world_size"])
            self.rounds.add(status["round_no"])
        return status

    def wait(self, what: str, predicate, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if predicate(status):
                self.say(f"{what}: round {status['round_no']}, world size {status['world_size']}, "
                         f"step {step_of(status)}")
                return status
            time.sleep(0.5)
        raise SystemExit(f"demo failed: not yet \"{what}\" after {timeout:.0f}s (see `petctl logs {JOB}`)")

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.petctl("logs", JOB, quiet=True).splitlines():
            node, _, rest = line.partition("] ")
            if rest.startswith("{"):
                try:
                    record = json.loads(rest)
                except ValueError:
                    continue
                if isinstance(record, dict) and "event" in record:
                    out.append({**record, "node": node.lstrip("[")})
        return sorted(out, key=lambda r: r.get("ts", 0))


def first_step_after(events: list[dict[str, Any]], launched: float) -> float:
    """Seconds from `run_job` to the job's first training step (the earliest `train.step` of any rank)."""
    steps = [e["ts"] for e in events if e["event"] == "train.step" and e.get("ts", 0) >= launched]
    if not steps:
        raise SystemExit("demo failed: the job trained, but its log has no train.step event")
    return min(steps) - launched


def step_of(status: dict[str, Any]) -> int:
    steps = [n.get("step") or 0 for n in status["nodes"].values()]
    return max(steps, default=0)


def world(size: int, min_step: int = 0):
    def check(status: dict[str, Any]) -> bool:
        members = [status["nodes"].get(n, {}) for n in status["ranks"]]
        return (status["world_size"] == size and all(m.get("world_size") == size for m in members)
                and step_of(status) >= min_step)
    return check


def rank_node(status: dict[str, Any], rank: int) -> str:
    return next(node for node, r in status["ranks"].items() if r == rank)


def run(demo: Demo) -> list[str]:
    """The scenario; returns what went wrong (empty when the job behaved)."""
    demo.petctl("setup")
    launched = time.time()
    demo.petctl("run_job", "--name", JOB, "--min", "1", "--max", "3", "--size", "2", "--wait",
                str(HERE / "train_ddp.py"), "--", "--steps", str(STEPS), "--ckpt-every", "10",
                "--step-time", "0.05")
    status = demo.wait("2 nodes training", world(2, min_step=10))
    demo.first_step_s = first_step_after(demo.events(), launched)
    demo.say(f"launch -> first training step: {demo.first_step_s:.1f}s "
             "(instances start, workers import torch, rendezvous, first step)")

    demo.say("taking rank 1 away without warning (SIGKILL of its process group)")
    demo.petctl("chaos", JOB, "--node", rank_node(status, 1), "--kill")
    demo.wait("the survivor re-formed alone", world(1))
    status = demo.wait("the replacement joined", world(2, min_step=step_of(status) + 10))

    if step_of(status) > STEPS - SCALE_ROOM:
        return [f"training reached step {step_of(status)} of {STEPS} before the scale-up: this machine is "
                "unusually slow for the demo"]
    demo.petctl("scale", JOB, "--size", "3")
    status = demo.wait("scaled to 3 nodes", world(3))
    demo.petctl("status", JOB)  # what a person would look at: one row per node

    demo.say("a spot interruption notice for rank 1: it is reclaimed 8 s later")
    demo.petctl("chaos", JOB, "--node", rank_node(status, 1), "--notice", "--grace", "8")
    demo.wait("rank 1 left before the reclaim", world(2))
    demo.say("training on with 2 nodes; the notice's replacement joins if it starts before the end")

    deadline = time.monotonic() + 240
    while json.loads(demo.petctl("jobs", "-o", "json", quiet=True))[0]["state"] == "running":
        if time.monotonic() > deadline:
            return ["the job did not finish within 4 minutes"]
        demo.status()
        time.sleep(1.0)
    final = demo.status()
    events = demo.events()
    resumed = [e["step"] for e in events if e["event"] == "train.resumed" and e.get("rank") == 0]
    saved = [e["step"] for e in events if e["event"] == "checkpoint.saved"]
    done = [e for e in events if e["event"] == "train.done"]
    print("\nsummary", flush=True)
    print(f"  final state       {final['state']} ({final.get('reason') or '-'})")
    print(f"  rounds            {len(demo.rounds)} (last {max(demo.rounds, default=0)})")
    print(f"  world sizes seen  {' -> '.join(map(str, demo.worlds))}")
    print(f"  resumed from      steps {', '.join(map(str, resumed)) or '-'} (checkpoints every 10 steps)")
    print(f"  finished          step {done[-1]['step'] if done else '-'} at world size "
          f"{done[-1]['world_size'] if done else '-'}")
    print(f"  launch -> step 0  {demo.first_step_s:.1f}s")
    print(f"  took              {time.monotonic() - demo.started:.0f}s\n", flush=True)

    problems = []
    if final["state"] != "succeeded":
        problems.append(f"the job ended {final['state']}, not succeeded")
    for size in (1, 2, 3):
        if size not in demo.worlds:
            problems.append(f"never saw world size {size}")
    if not resumed:
        problems.append("training never resumed from a checkpoint")
    if not done or done[-1]["step"] != STEPS:
        problems.append(f"training did not reach step {STEPS}")
    if saved and resumed and any(r > max(saved) for r in resumed):
        problems.append("resumed from a step that was never checkpointed")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true",
                        help="keep the demo's PETCTL_HOME and etcd (logs, checkpoints) afterwards")
    parser.add_argument("--home", type=Path, help="PETCTL_HOME to use (default: a new temporary directory)")
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="petctl-demo-"))
    home.mkdir(parents=True, exist_ok=True)
    demo = Demo(home=home)
    print(f"petctl demo; state in {demo.home}\n", flush=True)
    problems = ["it stopped early"]
    try:
        problems = run(demo)
    finally:
        if args.keep or problems:  # stop the job, keep etcd and every log for a look around
            subprocess.run([sys.executable, "-m", "petctl", "kill_job", JOB], env=demo.env,
                           capture_output=True)
            print(f"kept: PETCTL_HOME={demo.home} petctl logs {JOB}  (then: petctl teardown --force)")
        else:
            subprocess.run([sys.executable, "-m", "petctl", "teardown", "--force"], env=demo.env,
                           capture_output=True)
            shutil.rmtree(demo.home, ignore_errors=True)
    for problem in problems:
        print(f"demo failed: {problem}", file=sys.stderr)
    if not problems:
        print("demo passed: the job shrank, grew back, resumed from its checkpoints and succeeded")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
