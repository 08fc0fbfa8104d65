"""What an agent's and the CLI's imports cost in CPU, with and without the dataclass method cache, beside
torchrun's.

    python bench/agentstart.py --out bench/results/agent-start.json

Why: every node starts an agent, and on a shared host (P5: 64 agents on 2 cores) the rendezvous waits for
their start-up CPU. Most of it is the imports. petctl/io/methodcache.py keeps the methods `@dataclass`
compiles, so a start no longer compiles them. This bench measures what that saves, in one run.

Each figure is a fresh process of the installed Python (`runmeta.installed_python`: petctl as a wheel
install has it, no editable finder), its user + system CPU from the kernel's accounting of children. Per
rep the commands take turns, in a rotating order, so a change in load falls on all:
- `bare interpreter`: `pass`, the floor every process pays;
- `agent, no cache`: the agent's imports (the agent and the default v3 store), compiling every dataclass,
  as every start did before the cache;
- `agent, warm cache`: the same imports with the cache installed first, as `petctl-agent` does; the
  file was written by the run's compile step, as an install writes it;
- `cli, no cache` and `cli, warm cache`: what `petctl` imports before it parses its command line (the
  group and its commands), without and with the console script's cache (written as a first run writes
  it);
- `torchrun`: `import torch.distributed.run`, what torchrun's agent imports, the anchor.
With `--callgrind` it also counts each command's instructions once under valgrind: a count that does not
move with the machine's load.

What it leaves out: the agent's set-up after its imports (services, the store's connection), which the
cache does not touch (P5's split measures launch → `agent.started` whole); the first start after an
install that did not warm the cache (worker_boot.sh.j2 warms it); hosts other than this one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path, like bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import runmeta  # noqa: E402
from bench.petctl_runner import BENCH  # noqa: E402

AGENT_IMPORTS = "import petctl.agent.agent, petctl.io.store.v3"
CLI_IMPORTS = runmeta.CLI_IMPORTS
COMMANDS = {
    "bare interpreter": "pass",
    "agent, no cache": AGENT_IMPORTS,
    "agent, warm cache": f"from petctl.io import methodcache; methodcache.install('agent'); {AGENT_IMPORTS}",
    "cli, no cache": CLI_IMPORTS,
    "cli, warm cache": f"from petctl.io import methodcache; methodcache.install('cli'); {CLI_IMPORTS}",
    "torchrun": "import torch.distributed.run",
}
WARM = ("agent, warm cache", "cli, warm cache")  # each checked warm before it is measured


def cpu_of(python: str, code: str, env: dict[str, str]) -> float:
    """User + system CPU seconds of one fresh `python -c code`. Raises CalledProcessError when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-c", code], env=env, check=True, capture_output=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def instructions_of(python: str, code: str, env: dict[str, str], scratch: Path) -> int:
    """Instructions one `python -c code` runs, counted by callgrind. Raises CalledProcessError or
    ValueError when valgrind fails or says no count."""
    out_file = f"--callgrind-out-file={scratch / 'cg.out'}"
    command = ["valgrind", "--tool=callgrind", out_file, python, "-c", code]
    run = subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=900)
    match = re.search(r"refs:\s+([\d,]+)", run.stderr)
    if match is None:
        raise ValueError(f"callgrind gave no count: {run.stderr[-300:]}")
    return int(match.group(1).replace(",", ""))


def checked_cache(python: str, env: dict[str, str]) -> dict[str, Any]:
    """Each warm-cache command's own report, by name: every method a hit, none compiled. Raises
    RuntimeError when a cache was not warm (its figures would then measure a cold start)."""
    states = {}
    for name in WARM:
        code = COMMANDS[name] + "; import json; print(json.dumps(methodcache.state()))"
        run = subprocess.run([python, "-c", code], env=env, check=True, capture_output=True, text=True)
        state = json.loads(run.stdout.strip().splitlines()[-1])
        if state["compiled"] or state.get("problem"):
            raise RuntimeError(f"the method cache of {name!r} is not warm: {state}")
        states[name] = state
    return states


def table(rows: dict[str, dict[str, Any]], reps: int) -> str:
    """Markdown: each command's median CPU and range, and its instruction count when counted."""
    counted = any("instructions" in r for r in rows.values())
    head = f"| command | CPU, median of {reps} (range) | "
    out = [head + ("instructions (callgrind) |" if counted else ""),
           "|---|---|" + ("---|" if counted else "")]
    for name, r in rows.items():
        cell = f"{r['cpu_ms']:.1f} ms ({r['cpu_ms_min']:.1f}-{r['cpu_ms_max']:.1f})"
        count = f" {r['instructions'] / 1e6:.0f}M |" if "instructions" in r else (" |" if counted else "")
        out.append(f"| {name} | {cell} |{count}")
    bare = rows["bare interpreter"]["cpu_ms"]
    out.append("")
    for who in ("agent", "cli"):
        cold, warm = rows[f"{who}, no cache"], rows[f"{who}, warm cache"]
        out.append(f"- {who}: warm over cold, CPU above the bare interpreter: "
                   f"{(warm['cpu_ms'] - bare) / (cold['cpu_ms'] - bare):.2f}" +
                   (f"; instructions: {warm['instructions'] / cold['instructions']:.2f}"
                    if "instructions" in warm else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--callgrind", action="store_true", help="also count instructions under valgrind")
    parser.add_argument("--out", default=str(BENCH / "results" / "agent-start-latest.json"))
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.callgrind and shutil.which("valgrind") is None:
        parser.error("--callgrind needs valgrind on PATH")
    meta = runmeta.start()  # compiles petctl and warms the agent's method cache, as an install does
    scratch = Path(tempfile.mkdtemp(prefix="petctl-agentstart-"))
    try:
        python = runmeta.installed_python(scratch / "venv")
        env = {**os.environ, "PYTHONPATH": str(runmeta.REPO)}
        cache = checked_cache(python, env)
        cpu: dict[str, list[float]] = {name: [] for name in COMMANDS}
        names = list(COMMANDS)
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                cpu[name].append(cpu_of(python, COMMANDS[name], env))
        rows: dict[str, dict[str, Any]] = {}
        for name, xs in cpu.items():
            rows[name] = {"cpu_ms": round(statistics.median(xs) * 1e3, 2),
                          "cpu_ms_min": round(min(xs) * 1e3, 2), "cpu_ms_max": round(max(xs) * 1e3, 2),
                          "cpu_s": [round(x, 4) for x in xs]}
            if args.callgrind:
                rows[name]["instructions"] = instructions_of(python, COMMANDS[name], env, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    runmeta.write(meta, Path(args.out), table(rows, args.reps), title="The agent's and the CLI's imports, "
                  "with and without the dataclass method cache", commands=COMMANDS, warm_cache_state=cache,
                  rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
