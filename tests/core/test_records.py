"""The wire records (petctl/core/records.py): every one round-trips, tolerates other versions, rejects
what is not a record, and is documented field by field in docs/ARCHITECTURE.md."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from pathlib import Path

import pytest

from petctl.core import records
from petctl.core.keys import JobKeys
from petctl.core.records import (
    BootRecord,
    Checkpoint,
    DoneRecord,
    JobResult,
    JoinRecord,
    NodeRecord,
    NodeStatus,
    Phase,
    Round,
    SaveNow,
    WireFormatError,
    WireRecord,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"

# One instance of each record with every field set away from its default.
SAMPLES: dict[type[WireRecord], WireRecord] = {
    SaveNow: SaveNow(node_id="n2", deadline=1700000100.5, reason="scale-up: n3", leaves=False),
    Round: Round(round=7, phase=Phase.FROZEN, ts=1700000000.25, restarts=2, cause="scale-up: n4",
                 save_now=SaveNow(node_id="n2", deadline=1700000100.5), prev_ranks={"n1": 0, "n2": 1},
                 ranks={"n1": 0, "n2": 1, "n4": 2}, world_size=3, master_addr="10.0.0.5", master_port=29500,
                 frozen_ts=1700000001.0, state="x", reason="y"),
    JoinRecord: JoinRecord(node_id="n4", addr="10.0.0.9", port=40123, ts=1700000000.5, prev_rank=3),
    NodeRecord: NodeRecord(node_id="n4", host_addr="10.0.0.9", pid=4242),
    DoneRecord: DoneRecord(ts=1700000009.0, failure="local rank 1 exited with code 1"),
    Checkpoint: Checkpoint(step=120, url="s3://b/jobs/j/checkpoints/ckpt-120", interval_s=42.5,
                           interval_reason="Young/Daly: save 1.2 s, one loss of every holder per 3.1 h",
                           save_s=1.2),
    NodeStatus: NodeStatus(node_id="n4", state="running", updated=1700000010.0, host_addr="10.0.0.9",
                           pid=4242, round=7, rank=2, world_size=3, restarts=2, step=130,
                           last_checkpoint=Checkpoint(step=120, url="file:///c/120"),
                           etcd_requests={"reads": 9, "writes": 4, "watches": 3},
                           failures={"watch": 1, "mirror": 2},
                           last_error=["Traceback (most recent call last):", "RuntimeError: boom"]),
    JobResult: JobResult(state="failed", reason="max_restarts=3 exhausted", ts=1700000020.0, round=9, job="j",
                         node="n1"),
    BootRecord: BootRecord(instance_id="i-0123456789abcdef0", event="failed", ts=1700000030.0,
                           error="cannot pull the image", log_tail=["attempt 1/6 failed", "FATAL: no"]),
}


def wire_classes() -> list[type[WireRecord]]:
    return [c for c in vars(records).values()
            if isinstance(c, type) and issubclass(c, WireRecord) and c is not WireRecord]


def test_every_record_has_a_sample_with_no_default_left():
    assert set(wire_classes()) == set(SAMPLES)
    for cls, sample in SAMPLES.items():
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                assert getattr(sample, f.name) != f.default, f"{cls.__name__}.{f.name} left at its default"


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_round_trip_is_the_identity(cls):
    sample = SAMPLES[cls]
    text = sample.to_json()
    assert cls.from_json(text) == sample
    assert cls.from_json(text.encode()) == sample
    assert json.loads(text).keys() == {f.name for f in dataclasses.fields(cls)}, "to_json writes every field"


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_unknown_keys_are_ignored_and_missing_optional_ones_default(cls):
    data = json.loads(SAMPLES[cls].to_json())
    assert cls.from_dict({**data, "from_a_newer_agent": [1, 2]}) == SAMPLES[cls]
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    minimal = cls.from_dict({k: v for k, v in data.items() if k in required})
    for f in dataclasses.fields(cls):
        if f.name not in required:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert getattr(minimal, f.name) == default


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
@pytest.mark.parametrize("text", [None, "", b"", "not json", "[1, 2]", "42", '"a string"', "null"])
def test_what_is_not_a_record_raises_wire_format_error(cls, text):
    with pytest.raises(WireFormatError):
        cls.from_json(text)


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_a_missing_required_field_raises(cls):
    data = json.loads(SAMPLES[cls].to_json())
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            with pytest.raises(WireFormatError, match=f.name):
                cls.from_dict({k: v for k, v in data.items() if k != f.name})


@pytest.mark.parametrize("bad", [{"phase": "paused"}, {"ranks": {"n1": "zero"}},
                                 {"prev_ranks": {"n1": None}}])
def test_a_round_with_a_bad_value_raises(bad):
    with pytest.raises(WireFormatError):
        Round.from_dict({**json.loads(SAMPLES[Round].to_json()), **bad})


def test_round_reads_what_the_previous_agents_wrote():
    """Values as the agents before the typed records wrote them (no prev_ranks, string ranks keys)."""
    old = {"round": 3, "phase": "frozen", "restarts": 0, "cause": "job start", "ts": 1.0, "preempt": None,
           "ranks": {"n1": 0, "n2": 1}, "world_size": 2, "master_addr": "h", "master_port": 5,
           "frozen_ts": 2.0}
    rnd = Round.from_dict(old)
    assert rnd.phase is Phase.FROZEN and rnd.ranks == {"n1": 0, "n2": 1} and rnd.prev_ranks == {}
    final = Round.from_dict({"round": None, "phase": "final", "state": "killed", "reason": "r", "ts": 3.0})
    assert final.phase is Phase.FINAL and final.round is None and final.state == "killed"


# --- docs/ARCHITECTURE.md's field lists ----------------------------------------------------------------
def documented_fields(doc: str) -> dict[str, list[str]]:
    """`### \\`Name\\`` headings followed by a `| field | ...` table: Name -> the fields in order."""
    out: dict[str, list[str]] = {}
    for match in re.finditer(r"^### `(\w+)`\n(.*?)(?=^#|\Z)", doc, re.M | re.S):
        rows = [line for line in match.group(2).splitlines() if line.startswith("|")]
        if rows and rows[0].replace(" ", "").startswith("|field|"):
            out[match.group(1)] = [re.match(r"\|\s*`(\w+)`", r).group(1) for r in rows[2:]]
    return out


def test_the_parser_reads_a_table():
    doc = "### `X`\nwords\n\n| field | type | meaning |\n|---|---|---|\n| `a` | int | x |\n| `b` | s | y |\n"
    assert documented_fields(doc) == {"X": ["a", "b"]}


def test_architecture_doc_lists_every_record_field_in_order():
    documented = documented_fields(DOC.read_text())
    for cls in wire_classes():
        assert cls.__name__ in documented, f"docs/ARCHITECTURE.md has no field table for {cls.__name__}"
        assert documented[cls.__name__] == [f.name for f in dataclasses.fields(cls)], cls.__name__
    assert set(documented) == {c.__name__ for c in wire_classes()}, "a documented record that does not exist"


def test_architecture_doc_lists_every_phase():
    section = DOC.read_text().split("### `Phase`", 1)[1].split("###", 1)[0]
    assert isinstance(Phase.JOINING, enum.Enum)
    assert re.findall(r"`(\w+)` \(", section) == [p.value for p in Phase]


# --- docs/ARCHITECTURE.md's key layout -------------------------------------------------------------------
def documented_keys(doc: str) -> dict[str, dict[str, str]]:
    """The `## etcd layout` table: key pattern -> its cells by column name."""
    section = doc.split("## etcd layout", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    out = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        out[cells[0].strip("`")] = dict(zip(head, cells, strict=True))
    return out


def test_architecture_doc_lists_every_key_a_job_writes_with_its_lease_and_revision():
    """Every key JobKeys builds, with placeholders for its parts, is a row of the layout table, and every
    row is such a key; each row says what the key lives under and what its revision is used for."""
    keys = JobKeys("j")
    built = {keys.spec, keys.desired, keys.node("<node_id>"), keys.round, f"{keys.done(0)}/<node_id>",
             keys.round_member(0, "<node_id>"), keys.node_status("<node_id>"), keys.result,
             keys.event("<node_id>", 0)}
    shapes = {k.removeprefix(keys.base + "/").replace("/0/", "/<n>/")
              .replace("00000000000000000000-", "<ns>-") for k in built}
    documented = documented_keys(DOC.read_text())
    assert set(documented) == shapes
    assert all(set(row) == {"key", "writer", "lease", "revision", "value"} for row in documented.values())
    leased = {k for k, row in documented.items() if row["lease"] != "none"}
    assert leased == {"live/nodes/<node_id>", "live/done/<n>/<node_id>", "rounds/<n>/<node_id>",
                      "status/<node_id>", "events/<ns>-<node_id>"}
    assert "compare-and-swap" in documented["live/round"]["writer"]
