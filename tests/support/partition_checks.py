"""What the partition tests assert, over what the processes wrote, whoever started them (the agent
harness or the local provider): the step ledger of tests/workloads/ledger_steps.py, its final weights,
the checkpoint store, and the events of the nodes."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl.elastic import manifest as mf
from petctl.elastic import open_object_store
from tests.support.agent_harness import WORKLOADS

STEPS = 150
CKPT_EVERY = 5
STEP_TIME = 0.08

Events = Callable[[str], list[dict[str, Any]]]  # name -> that event of every node, "node" set, oldest first


def workload_env(results: Path) -> dict[str, str]:
    return {"STEPS": str(STEPS), "STEP_TIME": str(STEP_TIME), "CKPT_EVERY": str(CKPT_EVERY),
            "RESULT_DIR": str(results)}


def reference_weights(steps: int) -> list[list[float]]:
    """The workload's own reference: the same steps applied once each, in this process."""
    spec = importlib.util.spec_from_file_location("ledger_steps", WORKLOADS / "ledger_steps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_weights(steps)


@dataclass
class Outcome:
    """A job's checkpoint directory, results directory and events."""

    ckpt_dir: Path
    results: Path
    events: Events

    def rank0_ledger(self) -> list[dict[str, Any]]:
        """Rank 0's step and resume lines, every node and round, in time order."""
        lines = self.events("train.step") + self.events("train.resumed")
        return sorted((e for e in lines if e["rank"] == 0), key=lambda e: e["ts"])

    def final_lineage(self) -> tuple[list[int], list[dict[str, Any]]]:
        """Replay rank 0's ledger: a resume at step r keeps the lineage's steps < r (what the checkpoint
        or snapshot of r - 1 holds) and drops the rest; each step appends. Every resume must load a state
        at least as new as the newest checkpoint committed before it (an in-memory snapshot may be newer),
        of a step the lineage applied. A step rank 0 did not live to log counts as applied when another
        rank logged it before the resume: a cut-off rank 0 can die inside a step's all-reduce that the
        survivors completed (gloo's ring hands them the sum before rank 0 gets its last chunk), and
        their snapshot of that step is then the newest state. Returns (the steps behind the final
        weights, the resumes)."""
        saved = self.events("checkpoint.saved")
        steps = self.events("train.step")
        lineage: list[int] = []
        resumes: list[dict[str, Any]] = []
        for e in self.rank0_ledger():
            if e["event"] == "train.step":
                lineage.append(e["step"])
                continue
            committed = [s["step"] for s in saved if s["ts"] < e["ts"]]
            assert e["step"] >= (max(committed) + 1 if committed else 0), (
                f"resumed at {e['step']}, the newest checkpoint committed before was {committed[-1:]}")
            since = resumes[-1]["ts"] if resumes else 0.0  # only this lineage's round(s) count
            logged = {s["step"] for s in steps if since < s["ts"] < e["ts"]}
            while len(lineage) < e["step"] and len(lineage) in logged:
                lineage.append(len(lineage))  # done by the survivors, unlogged by the rank 0 cut off in it
            assert lineage[:e["step"]] == list(range(e["step"])), "resumed past steps never applied"
            del lineage[e["step"]:]
            resumes.append(e)
        return lineage, resumes

    def weights(self) -> dict[str, Any]:
        """The final weights and which node (the final round's rank 0) wrote them."""
        files = sorted(self.results.glob("weights-*.json"))
        assert len(files) == 1, f"expected the final round's rank 0 alone to write weights: {files}"
        return {"node": files[0].stem.removeprefix("weights-"), **json.loads(files[0].read_text())}

    def assert_exact_weights(self) -> str:
        """The final weights are STEPS steps applied once each; returns the node that wrote them."""
        final = self.weights()
        assert final["weights"] == reference_weights(STEPS), "final weights differ: a step twice or missing"
        return final["node"]

    def manifests(self) -> list[mf.Manifest]:
        store = open_object_store(self.ckpt_dir.as_uri())
        return [mf.read_manifest(store, step) for step in mf.manifest_steps(store)]

    def manifests_by(self, node: str, since: float) -> list[int]:
        """Steps of the checkpoints `node` committed at or after `since`."""
        return [m.step for m in self.manifests() if m.meta["node_id"] == node and m.created >= since]

    def data_written_since(self, since: float) -> set[int]:
        """Steps whose data objects (committed or not) were written at or after `since` (file mtimes)."""
        return {int(m.group(1)) for path in self.ckpt_dir.rglob("*") if path.is_file()
                and path.stat().st_mtime >= since and (m := mf.DATA_RE.match(f"{path.parent.name}/"))}

    def lost_events(self, node: str, since: float) -> list[dict[str, Any]]:
        return [e for e in self.events("membership.lost") if e["ts"] > since and node in e["nodes"]]

    def assert_survivors_own_the_store(self, victim: str, survivors: set[str], t_lost: float) -> None:
        """Nothing the cut-off node wrote became visible, or was even written, after it was dropped."""
        late = self.manifests_by(victim, t_lost)
        assert late == [], f"the partitioned node committed checkpoints {late} after it was dropped"
        assert [e["step"] for e in self.events("checkpoint.saved")
                if e["node"] == victim and e["ts"] >= t_lost] == []
        survivors_steps = {m.step for m in self.manifests() if m.meta["node_id"] in survivors}
        written_late = self.data_written_since(t_lost)
        assert written_late, "the survivors' own checkpoints should show up as written after the drop"
        assert written_late <= survivors_steps, (
            f"data of steps {sorted(written_late - survivors_steps)} written after the drop by someone "
            "other than the survivors")

    def measure(self, out: Path, t_cut: float, detection: float, resumed: dict[str, Any]) -> None:
        """For the record (nobody here reads it): detection time, where the survivors resumed."""
        before_cut = [e["step"] for e in self.rank0_ledger()
                      if e["event"] == "train.step" and e["ts"] < t_cut]
        out.write_text(json.dumps({
            "detection_s": round(detection, 3), "resumed_at": resumed["step"],
            "steps_redone": max(before_cut) + 1 - resumed["step"],
            "resumed_after_cut_s": round(resumed["ts"] - t_cut, 3)}))
