"""docs/aws.md's first script is what README's AWS steps run (issue 44.10): a pip user has no examples/
directory, so the script is shown inline. It is run here as the agent runs it (torchrun's environment,
$PETCTL_CHECKPOINT_URL), twice: the second run resumes from the first one's checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def first_script() -> str:
    docs = (REPO / "docs" / "aws.md").read_text()
    section = docs.split("\n## A first script\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_points_at_the_first_script_and_passes_its_arguments():
    readme = (REPO / "README.md").read_text()
    step = readme.split("## AWS", 1)[1].split("\n4. ", 1)[1].split("\n5. ", 1)[0]
    assert 'docs/aws.md, "A first script"' in step
    assert "train.py -- --lr 3e-4" in step and 'add_argument("--lr"' in first_script()


def test_the_first_script_trains_saves_and_resumes(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(first_script())
    checkpoints = tmp_path / "checkpoints"
    env = {**os.environ, "PETCTL_CHECKPOINT_URL": checkpoints.as_uri(), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(script), "--lr", "3e-4", "--steps", "60"]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = sorted(p.name for p in checkpoints.rglob("*") if p.is_file())
    assert saved, "no checkpoint was written"
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
