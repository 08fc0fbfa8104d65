"""The control-dir protocol shared by the agent and petctl.elastic (petctl/io/controlfiles.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from petctl.io import controlfiles as cf


def test_save_now_flag_round_trip(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert not cf.save_now_pending(control) and not cf.save_now_pending(None)
    cf.write_save_now(control, "i-1", 123.5)
    assert cf.save_now_pending(control)
    assert cf.read_save_now(control) == {"node_id": "i-1", "deadline": 123.5}
    assert [p.name for p in control.iterdir()] == ["save_now"]  # no temporaries left behind


def test_saved_reports(tmp_path: Path) -> None:
    assert cf.read_saved(tmp_path / "missing") == {}
    cf.write_saved(tmp_path, 0, 41)
    (tmp_path / "saved.1").write_text("{torn")
    (tmp_path / "saved.x").write_text('{"step": 1}')
    assert cf.read_saved(tmp_path) == {0: 41}
    assert not cf.all_saved(tmp_path, 2)
    cf.write_saved(tmp_path, 1, 41)
    assert cf.all_saved(tmp_path, 2)


def test_markers_and_clear(tmp_path: Path) -> None:
    assert not cf.speaks_protocol(tmp_path, 1)
    cf.mark_elastic(tmp_path, 0)
    assert cf.speaks_protocol(tmp_path, 1) and not cf.speaks_protocol(tmp_path, 2)
    cf.write_save_now(tmp_path, "n", 0)
    cf.write_saved(tmp_path, 0, 3)
    cf.clear(tmp_path)
    assert not cf.save_now_pending(tmp_path) and cf.read_saved(tmp_path) == {}
    assert cf.speaks_protocol(tmp_path, 1)  # a running worker's marker survives a plain clear
    cf.clear(tmp_path, markers=True)
    assert list(tmp_path.iterdir()) == []


def test_env(tmp_path: Path) -> None:
    assert cf.control_dir_from_env({}) is None
    assert cf.control_dir_from_env({"PETCTL_CONTROL_DIR": str(tmp_path)}) == tmp_path


def test_agent_modules_import_without_torch_or_boto3() -> None:
    code = ("import sys; import petctl.io.controlfiles, petctl.agent.imds, petctl.agent.notices, "
            "petctl.providers.local.metadata_server; "
            "bad = [m for m in ('torch', 'boto3', 'botocore') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_checkpointer_marks_the_worker(tmp_path: Path, monkeypatch) -> None:
    from petctl.elastic import Checkpointer

    monkeypatch.setenv("LOCAL_RANK", "0")
    with Checkpointer((tmp_path / "ckpt").as_uri(), control_dir=tmp_path / "control",
                      cache_dir=tmp_path / "cache"):
        assert cf.speaks_protocol(tmp_path / "control", 1)
