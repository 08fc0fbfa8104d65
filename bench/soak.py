"""A seeded soak of random, overlapping faults against one running job on the local provider, judged by
an oracle after every fault and at the end:

    python bench/soak.py --faults 200 --seed 7 [--nodes 3|4] [--store v3|v2] [--rate KIND=W ...]
                         [--overlap 0.5] [--out NAME]

The history comes from the seed (bench/soakplan.py: the same seed, the same faults in the same order at
the same offsets). Each fault is carried out through `petctl chaos`, `petctl scale`, a signal to a worker
or to etcd; the job is tests/workloads/data_train.py with ElasticSampler and a fixed global batch, its
rank 0 ledgering every step. Before each fault and at the end the oracle (bench/soakoracle.py) judges
the history so far from the ledger and the agents' events; at the end also the final weights against a
one-process replay, `petctl status`'s accounting against the ledger, and what `kill_job` left behind.

Writes bench/results/<out>.json (the seed, the plan, every fault with its recovery, every invariant,
runmeta) and <out>.md (the table), prints one line: faults, violations, recovery p50/p99. With a
violation (or --keep-logs) the job's node logs are kept beside the report (<out>-logs/). Exit status 1
on a violation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench import runmeta, soakoracle, soakplan  # noqa: E402
from bench.soakoracle import Cadence, Fault, JobEnd, Join, Leftovers, Resume, Step, Violation  # noqa: E402
from petctl.core.eventlog import parse_line  # noqa: E402

WORKLOAD = REPO / "tests" / "workloads" / "data_train.py"
JOB = "soak"
HEARTBEAT_TTL = 2.0  # the job's liveness lease: the oracle lets a round ride out a freeze about this short
FAST = ["--timeout", f"heartbeat_ttl={HEARTBEAT_TTL:g}", "--timeout", "last_call=0.5",
        "--timeout", "stop_grace=2", "--timeout", "imds_interval=0.5"]
DATA = {"DATA_SIZE": 100, "GLOBAL_BATCH": 24, "MICRO": 4, "SEED": 7}
CKPT_EVERY = 10  # the durable interval: what a resume may redo when no node of the round before survived
TAIL_STEPS = 15  # steps trained after the last fault, before the job is told to end


def log(msg: str) -> None:
    print(json.dumps({"ts": round(time.time(), 3), "event": "soak", "msg": msg}), flush=True)


# --- the job, through the CLI -----------------------------------------------------------------------------
@dataclass
class Cli:
    """`petctl` as a user runs it, with the soak's own PETCTL_HOME."""

    home: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Raises RuntimeError when `check` and the command fails (its one-line error included)."""
        proc = subprocess.run([sys.executable, "-m", "petctl", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"petctl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def settings(self) -> dict[str, Any]:
        return json.loads((self.home / "config.json").read_text())["settings"]["local"]

    @property
    def job_dir(self) -> Path:
        return self.home / "local" / "jobs" / JOB


# --- reading the history (the I/O edge of the oracle) -----------------------------------------------------
def read_ledger(ledger_dir: Path) -> tuple[list[Step], list[Resume]]:
    """Rank 0's ledger: steps and resumes, oldest first; a line cut short (a SIGKILL) is skipped."""
    steps, resumes = [], []
    path = ledger_dir / "data.jsonl"
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            continue
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "step":
            steps.append(Step(e["ts"], e["step"], e["round"], e["world"], e["node"]))
        elif e.get("event") == "resumed":
            resumes.append(Resume(e["ts"], e["start"], e["round"], e["world"], e["node"]))
    return sorted(steps, key=lambda s: s.ts), sorted(resumes, key=lambda r: r.ts)


def read_joins(job_dir: Path) -> list[Join]:
    """Every node's `rendezvous.complete` from the agents' logs."""
    return read_nodes(job_dir)[0]


NODE_EVENTS = ('"rendezvous.complete"', '"snapshot.enabled"', '"snapshot.every"')


def read_nodes(job_dir: Path) -> tuple[list[Join], list[Cadence]]:
    """From the agents' logs (their workers' events forwarded): every node's `rendezvous.complete`, and
    its snapshot interval as its workers set it (`snapshot.enabled`: 1 or the fixed K; `snapshot.every`:
    the cadence's changes)."""
    joins, cadences = [], []
    for path in sorted(job_dir.glob("instances/*/agent.log")):
        node = path.parent.name
        for line in path.read_text(errors="replace").splitlines():
            if not any(name in line for name in NODE_EVENTS):
                continue
            e = parse_line(line)
            event = e.get("event") if e is not None else None
            if event == "rendezvous.complete":
                joins.append(Join(e["ts"], node, int(e["round"]), int(e["rank"]), int(e["world_size"])))
            elif event in ("snapshot.enabled", "snapshot.every"):
                cadences.append(cadence_of(e, node))
    return joins, cadences


def cadence_of(event: dict, node: str) -> Cadence:
    """The snapshot interval a `snapshot.enabled` or `snapshot.every` event sets on `node`: its `every`,
    the K in force (a sharded ring's ranks each say the K their ring agreed, once the snapshot it follows
    is whole; a rank's own `snapshot.proposed` is not read: it binds nothing); 1 when it says none."""
    every = event.get("every")
    return Cadence(event["ts"], node, every if isinstance(every, int) else 1)


def node_event_seen(job_dir: Path, node: str, event: str) -> bool:
    path = job_dir / "instances" / node / "agent.log"
    return path.exists() and f'"event":"{event}"' in path.read_text(errors="replace")


# --- carrying faults out ----------------------------------------------------------------------------------
@dataclass
class Clear:
    """An action due later (a thaw, etcd back), that clears fault `index`."""

    due: float
    index: int
    what: str
    arg: str = ""


@dataclass
class Soak:
    cli: Cli
    ledger: Path
    nodes: int
    faults: list[Fault] = field(default_factory=list)
    clears: list[Clear] = field(default_factory=list)
    _marked: tuple[float, int] = (0.0, 0)
    etcd_busy: int | None = None  # the etcd fault under way: another one waits for it to clear
    desired: int = 0
    notes: list[str] = field(default_factory=list)
    accounting: dict[str, Any] = field(default_factory=dict)  # status's count and the ledger's, at the end

    # -- time passes, due clears run --
    def pump(self, until: float) -> None:
        while True:
            now = time.time()
            for c in [c for c in self.clears if c.due <= now]:
                self.clears.remove(c)
                self._clear(c)
            if now >= until:
                return
            time.sleep(min(0.1, until - now))

    def _clear(self, c: Clear) -> None:
        if c.what == "unfreeze":
            thaw = self.cli.run("chaos", JOB, "--node", c.arg, "--unfreeze", check=False)
            lines = thaw.stderr.strip().splitlines() if thaw.returncode != 0 else []
            error = lines[-1] if lines else ""
            if thaw.returncode != 0 and "cannot unfreeze" not in error and "no instance" not in error:
                # Still frozen: a thaw that failed clears nothing. Try again in a second, and say so once.
                if not any(n.startswith(f"fault {c.index}: thaw") for n in self.notes):
                    self.notes.append(f"fault {c.index}: thaw of {c.arg} failed, retried: {error}")
                    log(f"fault {c.index}: thaw of {c.arg} failed, retrying: {error}")
                self.clears.append(Clear(time.time() + 1.0, c.index, c.what, c.arg))
                return
        elif c.what == "etcd_thaw":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(c.arg), signal.SIGCONT)
        elif c.what == "etcd_start":
            restart_etcd(self.cli, c.arg)
        if c.what in ("etcd_thaw", "etcd_start"):
            self.etcd_busy = None
        f = self.faults[c.index]
        self.faults[c.index] = Fault(**{**asdict(f), "cleared": time.time()})
        log(f"fault {c.index} cleared: {c.what} {c.arg}")

    def wait_recovered(self, timeout: float) -> None:
        """Until no fault is pending (recovered, ended or judged hung) and nothing is left to clear."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            steps, _ = read_ledger(self.ledger)
            outcomes, _ = soakoracle.recoveries(self.faults, steps, time.time(),
                                                joins=read_joins(self.cli.job_dir), lease=HEARTBEAT_TTL)
            if not self.clears and all(o.state != "pending" for o in outcomes):
                return
            self.pump(time.time() + 0.5)
        raise RuntimeError(f"faults still pending after {timeout:.0f}s")

    def round_now(self) -> int:
        steps, resumes = read_ledger(self.ledger)
        return max([s.round for s in steps] + [r.round for r in resumes], default=0)

    def status(self) -> dict[str, Any]:
        return self.cli.json("status", JOB)

    def ranked(self) -> list[str]:
        """The current round's nodes in rank order."""
        ranks = self.status().get("ranks") or {}
        return [n for n, _ in sorted(ranks.items(), key=lambda kv: kv[1])]

    def mark(self) -> None:
        """The fault lands now: its injection time and the round it hit (taken just before the signal or
        the command that injects it, after the look-ups that aim it, which take seconds on 2 cores)."""
        self._marked = (time.time(), self.round_now())

    def inject(self, p: soakplan.PlannedFault) -> Fault:
        """Carry out one planned fault; a fault that cannot be carried out now is recorded skipped."""
        self.mark()
        try:
            target, skipped = self._do(p)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # the node went, the CLI refused: recorded
            target, skipped = "", f"not injected: {e}"
        t0, round_at = self._marked
        base = {"index": p.index, "kind": p.kind, "injected": t0, "cleared": t0, "round_at": round_at,
                "grace": p.grace}
        if p.kind in ("etcd_stall", "etcd_down") and not skipped:
            self.etcd_busy = p.index
        if p.kind in ("freeze", "etcd_stall", "etcd_down") and not skipped:
            self.clears.append(Clear(t0 + p.hold, p.index, {"freeze": "unfreeze", "etcd_stall": "etcd_thaw",
                                                            "etcd_down": "etcd_start"}[p.kind], target))
        size = self.desired if p.kind in soakoracle.SCALES and not skipped else None
        fault = Fault(**base, target=target, skipped=skipped, size=size)
        if p.kind == "notice_in_reform" and not skipped:  # cleared at its second half, the notice
            fault = Fault(**{**base, "cleared": time.time()}, target=target)
        log(f"fault {p.index} {p.kind} {target} {skipped}".rstrip())
        return fault

    def _do(self, p: soakplan.PlannedFault) -> tuple[str, str]:
        """(target, why skipped or "")."""
        cli, k = self.cli, p.kind
        if k in ("kill", "freeze", "term", "notice", "rebalance"):
            nodes = self.ranked()
            if not nodes:
                return "", "no round to aim at"
            node = nodes[p.pick % len(nodes)]
            self.mark()
            cli.run("chaos", JOB, "--node", node, f"--{k}", *(["--grace", str(p.grace)]
                                                             if k in ("notice", "rebalance") else []))
            return node, ""
        if k == "worker_crash":
            return self._crash_worker(p.pick)
        if k in ("scale_up", "scale_down"):
            up = (k == "scale_up" and self.desired < self.nodes) or self.desired <= 2
            self.desired += 1 if up else -1
            self.mark()
            cli.run("scale", JOB, "--size", str(self.desired))
            turned = "" if up == (k == "scale_up") else f" ({'up' if up else 'down'}: at the edge)"
            return f"size {self.desired}{turned}", ""
        if k == "burst":
            up = self.desired < self.nodes and (p.pick % 2 == 0 or self.desired <= 2)
            d = 1 if up else -1
            sizes = [self.desired + d, self.desired, self.desired + d]
            self.mark()
            for i, size in enumerate(sizes):
                cli.run("scale", JOB, "--size", str(size))
                if i < 2:
                    time.sleep((p.pick >> (4 * i)) % 8 / 8.0)
            self.desired = sizes[-1]
            return "sizes " + ",".join(map(str, sizes)), ""
        if k in ("etcd_stall", "etcd_down") and self.etcd_busy is not None:
            return "", f"etcd is stalled or down already (fault {self.etcd_busy})"
        if k == "etcd_stall":
            pid = int(cli.settings()["etcd_pid"])
            os.kill(pid, signal.SIGSTOP)
            return str(pid), ""
        if k == "etcd_down":
            return stop_etcd(cli), ""
        if k == "joiner_lost":
            return self._lose_joiner()
        if k == "notice_in_reform":
            nodes = self.ranked()
            if len(nodes) < 2:
                return "", "fewer than 2 nodes: no one to notice after the kill"
            victim, noticed = nodes[p.pick % len(nodes)], nodes[(p.pick + 1) % len(nodes)]
            self.mark()
            cli.run("chaos", JOB, "--node", victim, "--kill")
            self.pump(time.time() + p.hold)
            cli.run("chaos", JOB, "--node", noticed, "--notice", "--grace", str(p.grace))
            return f"{victim} killed, {noticed} noticed", ""
        raise ValueError(f"unknown fault kind {k!r}")

    def _crash_worker(self, pick: int) -> tuple[str, str]:
        """SIGKILL one worker process of the newest round that has recorded its pids."""
        pids_dir = self.ledger / "pids"
        records = [json.loads(p.read_text()) for p in pids_dir.glob("*-*") if not p.name.startswith(".")]
        if not records:
            return "", "no worker has recorded its pid yet"
        newest = max(r["round"] for r in records)
        mine = sorted((r for r in records if r["round"] == newest), key=lambda r: r["rank"])
        r = mine[pick % len(mine)]
        try:
            cmdline = Path(f"/proc/{r['pid']}/cmdline").read_bytes()
        except OSError:
            return "", f"worker pid {r['pid']} (round {newest}) already gone"
        if b"petctl" not in cmdline and b"data_train" not in cmdline:
            return "", f"pid {r['pid']} is no longer a worker"
        self.mark()
        try:
            os.kill(r["pid"], signal.SIGKILL)
        except ProcessLookupError:  # it exited after the look above (its round was re-forming)
            return "", f"worker pid {r['pid']} (round {newest}) exited before the kill"
        return f"{r['node']} rank {r['rank']} pid {r['pid']}", ""

    def _lose_joiner(self) -> tuple[str, str]:
        """Scale up by one; kill the new node right after it got ready (its registration is what asks the
        others to save first)."""
        if self.desired >= self.nodes:
            return "", "at --nodes: no room for a joiner"
        before = {h["host_id"] for h in self.cli.json("hosts", JOB)}
        self.desired += 1
        self.cli.run("scale", JOB, "--size", str(self.desired))
        deadline = time.time() + 60
        new = ""
        while time.time() < deadline and not new:
            hosts = {h["host_id"] for h in self.cli.json("hosts", JOB)}
            fresh = sorted(hosts - before)
            if fresh and node_event_seen(self.cli.job_dir, fresh[0], "workers.warm_ready"):
                new = fresh[0]
            self.pump(time.time() + 0.2)
        if not new:
            return "", "the joiner did not get ready in 60 s"
        self.pump(time.time() + 0.3)
        self.mark()
        self.cli.run("chaos", JOB, "--node", new, "--kill")
        return new, ""


def stop_etcd(cli: Cli) -> str:
    """SIGKILL the local etcd; returns "pid client_port peer_port" for `restart_etcd`."""
    settings = cli.settings()
    pid = int(settings["etcd_pid"])
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    peer = next(a for a, b in zip(args, args[1:], strict=False) if a == b"--listen-peer-urls")
    peer_url = args[args.index(peer) + 1].decode()
    client = int(settings["etcd_endpoint"].rsplit(":", 1)[1])
    os.kill(pid, signal.SIGKILL)
    return f"{pid} {client} {int(peer_url.rsplit(':', 1)[1])}"


def restart_etcd(cli: Cli, stopped: str) -> None:
    """Start the local etcd again on the same ports with its data (what a crash and a restart do), and
    record the new pid where `teardown` looks. Raises what etcd's start raises."""
    from petctl.io.etcdauth import SecureEtcdDir, start_secure
    from petctl.io.procs import start_ticks

    _, client, peer = (int(x) for x in stopped.split())
    settings = cli.settings()
    pki = Path(settings["etcd_pki"])
    server = start_secure(SecureEtcdDir(pki), pki.parent, log_path=pki.parent / "etcd.log", detach=True,
                          ports=(client, peer))
    config = json.loads((cli.home / "config.json").read_text())
    config["settings"]["local"].update(etcd_pid=server.pid, etcd_start=start_ticks(server.pid))
    (cli.home / "config.json").write_text(json.dumps(config, indent=1))


# --- after kill_job ---------------------------------------------------------------------------------------
def home_processes(home: Path, but: tuple[int, ...] = ()) -> list[str]:
    """Live processes whose environment names this PETCTL_HOME (every process the local provider
    starts inherits it), but `but`: "pid command" each."""
    needle = f"PETCTL_HOME={home}".encode()
    procs = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), *but):
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
        if stat != "Z" and needle in env:
            procs.append(f"{entry} {cmd}")
    return procs


def find_leftovers(cli: Cli, snapshot_root: Path) -> Leftovers:
    """What kill_job must not leave: the job's processes (any with this home but the shared etcd), its
    heartbeats (`live/nodes/`), its nodes' snapshot directories. The job's record (spec, result, status,
    events, join records) stays by design, each under its TTL, until the name is reused or `teardown`."""
    from petctl.core.keys import JobKeys
    from petctl.io.etcdpki import EtcdTls
    from petctl.io.store import open_store

    settings = cli.settings()
    procs = home_processes(cli.home, but=(int(settings["etcd_pid"]),))
    keys: list[str] = []
    store = open_store(settings["etcd_endpoint"], settings.get("store") or "v3",
                       EtcdTls.in_dir(Path(settings["etcd_pki"]) / "root"), 5.0)
    try:
        base = JobKeys(JOB).base
        keys += sorted(store.list(f"{base}/live/nodes").values())
    finally:
        store.close()
    files = sorted(str(p) for p in snapshot_root.glob(f"petctl-snap.{JOB}.*"))
    return Leftovers(processes=procs, live_keys=keys, files=files)


# --- the run ----------------------------------------------------------------------------------------------
def judge(soak: Soak, now: float, end: JobEnd | None = None) -> tuple[list, list[Violation], list]:
    """The oracle over the history so far: outcomes, violations, resumes judged."""
    steps, resumes = read_ledger(soak.ledger)
    joins, cadences = read_nodes(soak.cli.job_dir)
    outcomes, violations = soakoracle.recoveries(soak.faults, steps, now, end, joins, lease=HEARTBEAT_TTL)
    violations += soakoracle.stalls(steps, soak.faults, outcomes, now, end=end)
    violations += soakoracle.agreement(joins, steps)
    found = soakoracle.redos(steps, resumes, soak.faults, outcomes, joins, CKPT_EVERY, cadences)
    violations += soakoracle.redo_violations(found, steps)
    return outcomes, violations, found


def first_per_invariant(seen: dict[str, dict[str, Any]], violations: list[Violation], when: str) -> None:
    for v in violations:
        seen.setdefault(v.invariant, {**v.to_dict(), "seen": when})


class Stopped(Exception):
    """The soak was asked to stop (SIGTERM, Ctrl-C). Its own class, so no handler of a fault's failures
    (RuntimeError, OSError, a timeout) takes it for one: it ends the run, the job is torn down, and the
    report says why."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--nodes", type=int, choices=(3, 4), default=3)
    ap.add_argument("--store", choices=("v3", "v2"), default="v3")
    ap.add_argument("--rate", action="append", default=[], metavar="KIND=WEIGHT")
    ap.add_argument("--overlap", type=float, default=0.5, help="chance a fault lands 0-5 s after the last")
    ap.add_argument("--out", help="report name under bench/results/ (default soak-<store>-<nodes>n-s<seed>-"
                                  "f<faults>)")
    ap.add_argument("--results", type=Path, default=BENCH / "results")
    ap.add_argument("--max-minutes", type=float, default=600.0)
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the node logs beside the report even with no violation (to study a run)")
    ap.add_argument("--workdir", type=Path, help="where the job's home and ledger go (default: a new temp "
                                                 "dir); removed after a run with no violation")
    args = ap.parse_args(argv)

    def stopped(signum: int, _frame: Any) -> None:  # SIGTERM or Ctrl-C: tear the job down, then report
        raise Stopped(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    meta = runmeta.start()
    rates = soakplan.parse_rates(args.rate)
    planned = soakplan.plan(args.faults, args.seed, rates, args.overlap)
    name = args.out or f"soak-{args.store}-{args.nodes}n-s{args.seed}-f{args.faults}"
    work = Path(tempfile.mkdtemp(prefix="petctl-soak-", dir=args.workdir))
    home, ledger, shm = work / "home", work / "ledger", work / "shm"
    ledger.mkdir(parents=True)
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PETCTL_HOME"}
    env.update(PETCTL_HOME=str(home), PYTHONUNBUFFERED="1", PETCTL_SNAPSHOT_ROOT=str(shm),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    cli = Cli(home, env)
    soak = Soak(cli, ledger, args.nodes, desired=args.nodes)
    seen: dict[str, dict[str, Any]] = {}
    end: JobEnd | None = None
    extra: list[Violation] = []
    t_start = time.time()
    limit = t_start + 60 * args.max_minutes
    try:
        cli.run("setup", *(["--option", "store=v2"] if args.store == "v2" else []))
        job_env = {**DATA, "LEDGER_DIR": ledger, "STEPS": 1_000_000, "STEP_TIME": 0.05,
                   "CKPT_EVERY": CKPT_EVERY, "END_FILE": 1}
        cli.run("run_job", "--name", JOB, *FAST, "--min", "1", "--max", str(args.nodes), "--size",
                str(args.nodes), "--replace-delay", "1", "--max-restarts", "100000",
                *[a for k, v in job_env.items() for a in ("--env", f"{k}={v}")], str(WORKLOAD))
        while len(read_ledger(ledger)[0]) < 5:
            if time.time() > t_start + 240:
                raise RuntimeError("the job ran no 5 steps in 240 s")
            time.sleep(0.5)
        log(f"training; {len(planned)} faults planned, seed {args.seed}")
        for p in planned:
            if time.time() > limit:
                raise RuntimeError(f"--max-minutes {args.max_minutes} passed at fault {p.index}")
            if p.after is None:
                soak.wait_recovered(600)
                state = next(j for j in cli.json("jobs") if j["name"] == JOB)["state"]
                if state != "running":  # ended under the faults: nothing left to inject into
                    log(f"the job is {state}: no more faults")
                    break
                soak.pump(time.time() + p.settle)
            else:
                soak.pump(soak.faults[-1].injected + p.after)
            _, violations, _ = judge(soak, time.time())
            first_per_invariant(seen, violations, f"before fault {p.index}")
            soak.faults.append(soak.inject(p))
        soak.wait_recovered(900)
        soak.pump(time.time() + 3)
        last = max(s.step for s in read_ledger(ledger)[0])
        target = last + TAIL_STEPS
        tmp = ledger / ".end.tmp"
        tmp.write_text(str(target))
        os.replace(tmp, ledger / "end")
        log(f"all faults done; ending the job at step {target}")
        deadline = time.time() + 300
        while True:
            info = next(j for j in cli.json("jobs") if j["name"] == JOB)
            if info["state"] != "running":
                break
            if time.time() > deadline:
                raise RuntimeError(f"the job did not end within 300 s of its end step: {info}")
            time.sleep(1.0)
        status = soak.status()
        end = JobEnd(time.time(), status.get("state", ""), status.get("reason") or "")
        if end.state != "succeeded":
            extra.append(Violation("recovery", f"the job ended {end.state}: {end.reason}"))
        final_path = ledger / "final.json"
        final = json.loads(final_path.read_text()) if final_path.exists() else None
        if final is not None:
            from tests.workloads.data_train import replay

            expected = replay(final["steps"], DATA["DATA_SIZE"], DATA["GLOBAL_BATCH"], DATA["SEED"])
            extra += soakoracle.weights(expected, final["weights"])
            if final["steps"] != target:
                extra.append(Violation("weights", f"the job ran {final['steps']} steps, asked {target}"))
        else:
            extra += soakoracle.weights([], None)
        outcomes, violations, found = judge(soak, time.time(), end)
        totals = soakoracle.ledger_totals(read_ledger(ledger)[0], found)
        told = status.get("accounting") or {}
        soak.accounting = {"ledger": totals, "status": {k: told.get(k) for k in (
            "steps_kept", "steps_lost", "steps_lost_lower_bound")}}
        extra += soakoracle.accounting(told, totals)
        cli.run("kill_job", JOB)
        left = find_leftovers(cli, shm)
        settle = time.time() + 10  # a killed agent's leased keys go within one heartbeat TTL (2 s here)
        while left != Leftovers() and time.time() < settle:
            time.sleep(1.0)
            left = find_leftovers(cli, shm)
        extra += soakoracle.leftovers(left)
    except Exception as e:  # noqa: BLE001 - the run broke: reported as a violation, the report still written
        where = traceback.extract_tb(e.__traceback__)[-1]
        extra.append(Violation("run", f"the soak could not go on: {type(e).__name__}: {e} (at "
                                      f"{Path(where.filename).name}:{where.lineno})",
                               {"traceback": traceback.format_exc()}))
        traceback.print_exc()
        outcomes, violations, found = judge(soak, time.time(), end)
    saved = work / "kept"  # the node logs, before teardown removes them: kept with the report on a violation
    for path in [*cli.job_dir.glob("**/*.log"), ledger / "data.jsonl"]:
        if path.exists():
            dest_path = saved / (path.relative_to(cli.job_dir) if path.is_relative_to(cli.job_dir)
                                 else path.name)
            dest_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest_path)
    cli.run("teardown", "--force", check=False, timeout=180)
    stray = home_processes(home)
    if stray:
        extra.append(Violation("leftovers", f"after teardown, {len(stray)} processes left: {stray[:5]}"))
    violations = violations + extra
    first_per_invariant(seen, violations, "at the end")
    line = soakoracle.summary_line(args.seed, outcomes, violations)
    kept_logs = ""
    if violations or args.keep_logs:
        dest = args.results / f"{name}-logs"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(saved, dest)
        kept_logs = str(dest)
    write_report(args, name, meta, planned, soak, outcomes, violations, seen, found, line, kept_logs)
    if not violations:
        shutil.rmtree(work, ignore_errors=True)
    print(line, flush=True)
    return 1 if violations else 0


def write_report(args: argparse.Namespace, name: str, meta: dict[str, Any], planned: list, soak: Soak,
                 outcomes: list, violations: list[Violation], seen: dict[str, Any], found: list, line: str,
                 kept_logs: str) -> None:
    """bench/results/<name>.json and .md (runmeta at the top of both)."""
    args.results.mkdir(parents=True, exist_ok=True)
    held = {inv: inv not in seen for inv in soakoracle.INVARIANTS}
    doc = {**runmeta.finish(meta), "seed": args.seed, "faults": args.faults, "nodes": args.nodes,
           "store": args.store, "overlap": args.overlap, "not_injected_locally": soakplan.NOT_LOCAL,
           "summary": line, "invariants": held, "first_violation": seen,
           "violations": [v.to_dict() for v in violations], "kept_logs": kept_logs,
           "accounting": soak.accounting, "notes": soak.notes,
           "recovery": soakoracle.recovery_table(o for o in outcomes if o.state != "skipped"),
           "history": [{**asdict(f), **{k: v for k, v in o.to_dict().items() if k not in ("index", "kind")}}
                       for f, o in zip(soak.faults, outcomes, strict=True)],
           "resumes": [r.to_dict() for r in found], "plan": [p.to_dict() for p in planned]}
    (args.results / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    m = doc["machine"]
    rows = ["| kind | faults | recovered | p50 s | p99 s |", "|---|---|---|---|---|"]
    for kind, r in doc["recovery"].items():
        rows.append(f"| {kind} | {r['faults']} | {r['recovered']} | {_f(r['p50'])} | {_f(r['p99'])} |")
    md = [f"# Soak {name}", "", f"`{doc['command']}`", "",
          f"commit {doc['commit']} (dirty: {doc['dirty']}), {m['cpu_count']} cores, load "
          f"{m['load_avg_start']} at start, {m.get('load_avg_end')} at end, {m.get('date')}", "",
          line, "", *rows, "", "Invariants: " + ", ".join(f"{k} {'held' if v else 'BROKEN'}"
                                                          for k, v in held.items()), "",
          f"Steps kept and lost, status against the ledger: {soak.accounting or 'not read'}", ""]
    for inv, v in seen.items():
        md.append(f"- first {inv} violation ({v['seen']}): {v['message']}")
    md += ["", "Not injected locally: " + "; ".join(f"{k} ({v})" for k, v in soakplan.NOT_LOCAL.items())]
    (args.results / f"{name}.md").write_text("\n".join(md) + "\n")


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
