"""What every bench result records about its run: the commit, whether the tree was dirty, the machine
(cores, load average at the start and at the end), and the command line.

    meta = runmeta.start()          # at the start of the run
    doc = {**runmeta.finish(meta), ...}   # when writing (each partial write refreshes the end)

A figure is only comparable with another if both ran on the same code, on a machine as loaded; a result
that does not say so cannot be quoted. Git may be missing (a copied tree, a device machine): the
commit is then None and `dirty` None. Or git may be there but name another commit: the device machine
keeps the session's first checkout's .git under later trees. So the sender can write its state first
(`python -m bench.runmeta --send`). When every tracked file's bytes match what the sender hashed, the
result names the sender's commit. When they differ, git's answer stands, or the sender's marked dirty.

`start` also compiles petctl's modules to bytecode, as `pip install` does on an instance. Without it, a
checkout under PYTHONDONTWRITEBYTECODE (this bench machine sets it) recompiles every module in every
agent process: work no installed petctl does, and that torch, the anchor's code, never does (its wheel
ships compiled). How much CPU that is per agent was lost in this machine's noise when last looked at.
It also writes the agent's dataclass method cache (petctl/io/methodcache.py), as the install does.

`installed_python` makes an interpreter that imports petctl as a wheel install has it, for the scenarios
that time process start-up (P5).
"""

from __future__ import annotations

import compileall
import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
UNTRACKED_LISTED = 20  # untracked paths a result lists; more are cut
SENT_STATE = ".bench-sent-state.json"  # the sender's git state, for a tree copied without its .git


def tree_digest(repo: Path, paths: list[str]) -> str:
    """sha256 over each path and its bytes, in the order given; a missing file hashes as absent."""
    h = hashlib.sha256()
    for rel in paths:
        h.update(rel.encode() + b"\0")
        try:
            h.update((repo / rel).read_bytes())
        except OSError:
            h.update(b"\0absent")
        h.update(b"\0")
    return h.hexdigest()


def send_state(repo: Path = REPO) -> Path:
    """Write SENT_STATE at the checkout's root: the commit, the dirty flag, and a digest of every tracked
    file, so a copy of the tree on a machine without git (the device machine) can say which code it ran.
    Raises RuntimeError when git cannot read the checkout, OSError when the file cannot be written."""
    state = git_state(repo)
    if state["commit"] is None:
        raise RuntimeError(f"{repo}: git cannot read this checkout; there is no state to send")
    paths = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True,
                           timeout=20).stdout.decode().split("\0")
    paths = sorted(p for p in paths if p)
    out = repo / SENT_STATE
    out.write_text(json.dumps({**state, "tracked": paths, "digest": tree_digest(repo, paths)}) + "\n")
    return out


def _sent_state(repo: Path) -> dict[str, Any] | None:
    """The sender's state (send_state), checked against this tree: `dirty` turns true when a tracked
    file's bytes differ from the sender's. None when there is no readable state file."""
    try:
        sent = json.loads((repo / SENT_STATE).read_text())
        paths, digest = list(sent["tracked"]), str(sent["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    same = tree_digest(repo, paths) == digest
    return {"commit": sent.get("commit"), "dirty": bool(sent.get("dirty")) or not same,
            "untracked": sent.get("untracked"),
            "git_state_from": "the sender's state file; the tracked files' bytes "
                              + ("match it" if same else "DIFFER from it")}


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """{"commit": `git rev-parse HEAD`, "dirty": a tracked file differs from it, "untracked": the paths git
    does not track (at most UNTRACKED_LISTED)}; None for each where git fails.

    `dirty` is `git describe --dirty`'s: the code measured is the commit's unless a tracked file changed.
    An untracked file (the run's own log redirected into the checkout, an earlier result) does not make
    it dirty, but it is listed, so a reader can judge."""
    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return run.stdout if run.returncode == 0 else None

    sent = _sent_state(repo)
    if sent is not None and not sent["dirty"]:
        return sent  # the files are exactly the sent commit's (a .git there may be older: the device's)
    head = git("rev-parse", "HEAD")
    if head is None and sent is not None:
        return sent
    tracked = git("status", "--porcelain", "--untracked-files=no")
    others = git("ls-files", "--others", "--exclude-standard")
    return {"commit": head.strip() if head else None,
            "dirty": None if tracked is None else bool(tracked.strip()),
            "untracked": None if others is None else others.splitlines()[:UNTRACKED_LISTED]}


def machine() -> dict[str, Any]:
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
    torch_version = None
    if "torch" in sys.modules:  # never import torch only to say which: a bench writer may not need it
        torch_version = getattr(sys.modules["torch"], "__version__", None)
    else:
        try:
            from importlib.metadata import PackageNotFoundError, version

            torch_version = version("torch")
        except (ImportError, PackageNotFoundError):
            pass
    return {"cpu_count": os.cpu_count(), "cpu_model": model, "mem_gib": mem_gib,
            "python": platform.python_version(), "torch": torch_version, "platform": platform.platform()}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def compile_petctl(repo: Path = REPO, failures: list[str] | None = None) -> bool:
    """Write the bytecode of every petctl module and the agent's dataclass method cache, as an instance's
    install does (`petctl-agent --warm`, worker_boot.sh.j2; see the module docstring), and the CLI's, as
    its first run does. True when all of it was written; otherwise `failures`, if given, gets one line
    per step that failed (which one, and the last line it wrote), so a record says which cache was cold."""
    failed = [] if failures is None else failures
    if not compileall.compile_dir(repo / "petctl", quiet=1, workers=1):
        failed.append("compileall: a petctl module did not compile")
    if not (repo / "petctl" / "agent" / "main.py").exists():  # a tree that has no agent (tests)
        return not failed
    paths = (str(repo), os.environ.get("PYTHONPATH", ""))  # the caller's PYTHONPATH may carry dependencies
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    warms = {"the agent's cache": [sys.executable, "-m", "petctl.agent.main", "--warm"]}
    if (repo / "petctl" / "cli" / "group.py").exists():  # what `petctl` imports, as its first run saves it
        warms["the CLI's cache"] = [sys.executable, "-c", CLI_WARM]
    for what, argv in warms.items():
        warm = subprocess.run(argv, cwd=repo, capture_output=True, text=True, env=env)
        if warm.returncode != 0 or warm.stderr.strip():
            last = (warm.stderr.strip().splitlines() or [f"exit {warm.returncode}"])[-1]
            failed.append(f"{what}: {last[:200]}")
    return not failed


# The console script's cache (petctl.cli.main), written as a user's first `petctl` run writes it. Under
# PYTHONDONTWRITEBYTECODE no run would, and P6 would time a start that compiles 200 dataclass methods.
CLI_IMPORTS = "import petctl.cli.group"  # what `petctl` imports before it parses its command line
CLI_WARM = (f"from petctl.io import methodcache; methodcache.install('cli'); {CLI_IMPORTS}; "
            "methodcache.warm('cli')")


INSTALLED = ("petctl from the checkout on sys.path, its dependencies from the bench's site-packages, "
             "and no editable-install finder: as the worker image's wheel install has it")


def installed_python(root: Path) -> str:
    """The path of a Python (a venv under `root`, made on the first call) that imports what this one
    does, as an instance's install has it: its one `.pth` puts this interpreter's site-packages on
    sys.path, and the node processes' PYTHONPATH puts the checkout there (bench.petctl_runner.node_env).

    Why: README installs petctl editable (`pip install -e`), and setuptools then runs a finder from a
    `.pth` in every Python that starts: CPU in every agent and every
    worker, which an instance (a wheel, worker_boot.sh.j2) and torch's own code never pay. P5 starts 64
    agents and 64 workers on 2 cores, so that start-up is in its rendezvous figure. The `.pth` files of
    the added directory are not run (Python runs only a site directory's own), which is what drops the
    finder. Raises subprocess.CalledProcessError or OSError when the venv cannot be made."""
    python = root / "bin" / "python"
    if python.exists():
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   capture_output=True)
    sites = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    made = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(made, "petctl-bench-deps.pth").write_text("".join(f"{site}\n" for site in sites))
    return str(python)


def start(argv: list[str] | None = None) -> dict[str, Any]:
    """The run's record at its start; `argv` defaults to this process's command line. Compiles petctl
    first (`compile_petctl`), and says whether that worked."""
    argv = list(sys.argv) if argv is None else list(argv)
    failures: list[str] = []
    compiled = compile_petctl(failures=failures)
    m = machine()
    m.update(load_avg_start=[round(x, 2) for x in os.getloadavg()], started=_now())
    return {**git_state(), "command": " ".join([Path(sys.executable).name, *argv]), "machine": m,
            "bytecode": "petctl compiled before the run, as an install has it" if compiled else
                        "petctl compiled only where its processes could write bytecode; failed: "
                        + "; ".join(failures)}


def finish(meta: dict[str, Any]) -> dict[str, Any]:
    """The record with the load average and the time at this write (the end, at the last write)."""
    m = {**meta["machine"], "load_avg_end": [round(x, 2) for x in os.getloadavg()], "date": _now()}
    return {**meta, "machine": m}


def write(meta: dict[str, Any], out: Path, table: str, **fields: Any) -> dict[str, Any]:
    """Write one bench's result: `fields` with the run's record (`finish(meta)`) as JSON at `out`, and
    `table` as Markdown beside it (`out` with `.md`); print the table and the load at both ends. Returns
    the document written. Raises OSError when `out` cannot be written."""
    doc = {**finish(meta), **fields}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"load average at the start {meta['machine']['load_avg_start']}, at the end "
          f"{doc['machine']['load_avg_end']}; written to {out}")
    return doc


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Write the checkout's git state for a copy without .git.")
    ap.add_argument("--send", action="store_true", help=f"write {SENT_STATE} at the checkout's root")
    if not ap.parse_args().send:
        ap.error("say --send")
    try:
        print(send_state())
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"bench.runmeta: {e}") from None
