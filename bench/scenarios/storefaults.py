"""P7 the rendezvous store fails under a running 3-node job: what petctl and torchrun users get.

- P7a: etcd frozen (SIGSTOP) for 6 s, then SIGCONT (a stalled etcd host or disk).
- P7b: etcd killed, its data wiped, and an empty etcd started on the same address 5 s later (what
  replacing the etcd host does: the fixed address survives, the data does not).
- P7c (torchrun c10d only): the c10d store lives in the first node's torchrun agent; that agent process
  alone (not its worker) is frozen for 6 s, the same stall as P7a for c10d's store.

Every repetition gets its own etcd (loopback), so one system's fault never touches the other's job. The
job trains past two checkpoints, then the store fails; `FAULT_TO_END` seconds after the fault started the
figures are read from the logs (`bench/storemetrics.py`): restarts, steps lost, the longest pause in
training, whether every node still ran steps at world 3 from `CHECK_AFTER` s after the fault on, and
whether every node process is alive.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from bench import phases, storemetrics
from bench.petctl_runner import PetctlJob
from bench.procs import Node, wait_for
from bench.scenarios import recovery
from bench.scenarios.common import Context
from bench.torchrun_runner import TorchrunJob

NODES = 3
CHECK_AFTER = 15.0  # the job must still be training this long after the fault started...
FAULT_TO_END = 20.0  # ...up to here, when the run ends and the figures are read
MIN_NODES = 2  # elastic like P1/P2; the goal is to stay at world 3

FAULTS: dict[str, dict[str, Any]] = {
    "P7a": {"title": "etcd frozen 6 s (SIGSTOP, SIGCONT)", "kind": "freeze", "seconds": 6.0,
            "systems": ("petctl", "torchrun-etcd-v2")},
    "P7b": {"title": "etcd killed, wiped, restarted empty on the same address after 5 s", "kind": "wipe",
            "seconds": 5.0, "systems": ("petctl", "torchrun-etcd-v2")},
    "P7c": {"title": "c10d store host (first node's torchrun agent, not its worker) frozen 6 s",
            "kind": "host-freeze", "seconds": 6.0, "systems": ("torchrun-c10d",)},
}


class OwnEtcd:
    """One run's etcd, which the scenario may freeze, or kill, wipe and start again on the same ports."""

    def __init__(self, root: Path) -> None:
        from petctl.io.etcd import EtcdServer

        self._start = EtcdServer.start
        self.root = root
        self.server = self._start(root / "etcd", log_path=root / "etcd.log")
        self.ports = (self.server.client_port, self.server.peer_port)

    def signal(self, sig: int) -> None:
        os.kill(self.server.pid, sig)

    def replace_empty(self, after: float) -> None:
        """SIGKILL, wipe the data, and after `after` s start an empty etcd on the same address."""
        t0 = time.time()
        self.signal(signal.SIGKILL)
        self.server.stop()  # reaps it
        shutil.rmtree(self.server.data_dir)
        time.sleep(max(0.0, t0 + after - time.time()))
        self.server = self._start(self.root / "etcd", log_path=self.root / "etcd.log", ports=self.ports)

    def close(self) -> None:
        try:
            self.signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.server.stop(remove_data=True)


class ExitWatch:
    """When each node process exited (polled every 0.1 s from a thread, so the fault can block)."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.exited: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="exit-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            for node in self.nodes:
                if node.name not in self.exited and node.proc.poll() is not None:
                    self.exited[node.name] = time.time()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return dict(self.exited)


def _start_job(ctx: Context, fid: str, system: str, rep: int, store: OwnEtcd | None):
    """A 3-node job of `workload.py` (min 2, max 3) against this run's own etcd (c10d: its own store)."""
    name = f"{fid.lower()}-{system.split('-')[-1]}-{rep}-{int(time.time()) % 100000}"
    root = ctx.dir(fid, system, f"rep{rep}")
    ckpt = f"file://{ctx.dir(fid, system, f'rep{rep}', 'checkpoints')}"
    if system == "petctl":
        assert store is not None
        job = PetctlJob.create(root, store.server.endpoint, name, min_size=MIN_NODES, max_size=NODES,
                               size=NODES, env=recovery.workload_env(), checkpoint_url=ckpt,
                               initial_wait=60.0)
        return job, [job.start() for _ in range(NODES)]
    tjob = TorchrunJob.create(root, system.removeprefix("torchrun-"), MIN_NODES, NODES, name,
                              etcd_port=store.server.client_port if store else None,
                              env={**recovery.workload_env(), "PETCTL_CHECKPOINT_URL": ckpt})
    nodes = []
    for _ in range(NODES):
        nodes.append(tjob.start())
        time.sleep(0.3)  # as in P1-P3
    return tjob, nodes


def _trained(nodes: list[Node], steps: int) -> bool:
    """Every node ran step `steps` or later at world 3."""
    for node in nodes:
        hits = [e for e in node.events("train.step") if int(e.get("world_size", 0)) == NODES]
        if not hits or int(hits[-1]["step"]) < steps:
            return False
    return True


def _inject(kind: str, seconds: float, store: OwnEtcd | None, nodes: list[Node]) -> float:
    """Do the fault; returns when it started (the store's SIGSTOP or SIGKILL). Blocks until it is over."""
    t_fault = time.time()
    if kind == "freeze":
        assert store is not None
        store.signal(signal.SIGSTOP)
        time.sleep(seconds)
        store.signal(signal.SIGCONT)
    elif kind == "wipe":
        assert store is not None
        store.replace_empty(seconds)
    elif kind == "host-freeze":  # the torchrun agent process only: its worker keeps running
        os.kill(nodes[0].proc.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(nodes[0].proc.pid, signal.SIGCONT)
    else:
        raise ValueError(f"unknown store fault {kind!r}")
    return t_fault


def run_once(ctx: Context, fid: str, system: str, rep: int) -> dict[str, Any]:
    fault = FAULTS[fid]
    result: dict[str, Any] = {"system": system, "rep": rep}
    store = OwnEtcd(ctx.dir(fid, system, f"rep{rep}", "store")) if fault["kind"] != "host-freeze" else None
    job = None
    try:
        job, nodes = _start_job(ctx, fid, system, rep, store)
        if not wait_for(lambda: _trained(nodes, recovery.WARM_STEPS), recovery.START_TIMEOUT, 0.2):
            result["error"] = f"job did not reach step {recovery.WARM_STEPS} at world {NODES}"
            return result
        if system == "petctl":  # as in P1-P3: warm pools refilled, should a restart be needed
            settled = wait_for(lambda: all(len(n.events("workers.warm_ready")) >= 2 for n in nodes),
                               recovery.WARM_SETTLE, 0.2)
            result["warm_settled"] = bool(settled)
        watch = ExitWatch(nodes)
        t_fault = _inject(fault["kind"], fault["seconds"], store, nodes)
        t_end = t_fault + FAULT_TO_END
        time.sleep(max(0.0, t_end - time.time()) + 0.5)  # +0.5 s: the last lines land in the logs
        exited = watch.stop()
        result.update(storemetrics.measure(nodes, system, NODES, t_fault, CHECK_AFTER, t_end))
        result["exited_after_s"] = {name: round(t - t_fault, 2) for name, t in exited.items()}
        return result
    finally:
        if job is not None:
            job.stop()
        if store is not None:
            store.close()


def run(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"title": "rendezvous store failures", "check_after_s": CHECK_AFTER,
                           "observed_s": FAULT_TO_END, "faults": {}}
    for fid, fault in FAULTS.items():
        systems = [s for s in ctx.systems if s in fault["systems"]]
        if not systems:
            continue
        res: dict[str, Any] = {"title": fault["title"], "runs": {}, "summary": {}}
        for system in systems:
            runs = []
            for rep in range(ctx.reps):
                ctx.log(f"{fid} {system} rep {rep + 1}/{ctx.reps}")
                r = run_once(ctx, fid, system, rep)
                ctx.log(f"{fid} {system} rep {rep + 1}: restarts {r.get('restarts')}, lost "
                        f"{r.get('steps_lost')}, pause {r.get('longest_pause_s')} s, training "
                        f"{r.get('training_after')}, alive {r.get('alive')}, error {r.get('error')}")
                runs.append(r)
            res["runs"][system] = runs
            res["summary"][system] = summarize_runs(runs)
        out["faults"][fid] = res
    return out


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if not r.get("error")]
    return {
        "restarts": phases.summarize([r.get("restarts") for r in ok]),
        "steps_lost": phases.summarize([r.get("steps_lost") for r in ok]),
        "stopped_runs": sum(r.get("steps_lost") is None for r in ok),  # stopped training, never resumed
        "longest_pause_s": phases.summarize([r.get("longest_pause_s") for r in ok]),
        "training_runs": sum(bool(r.get("training_after")) for r in ok),
        "all_alive_runs": sum(all((r.get("alive") or {"": False}).values()) for r in ok),
        "runs": len(ok),
        "errors": [r["error"] for r in runs if r.get("error")],
        "exited_after_s": phases.summarize([t for r in ok for t in (r.get("exited_after_s") or {}).values()]),
        "last_errors": sorted({e for r in ok for e in (r.get("last_error") or {}).values() if e}),
    }
