"""The fake Deep Learning AMI sees the test environment's packages, also when the tests run in a virtual
environment, as README's users run them (issue 44.9): there `venv --system-site-packages` reaches the
base interpreter's packages, not the venv's, and every emulated boot stopped at "No package metadata was
found for torch"."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_fake_amis_python_sees_the_packages_of_a_venv_that_runs_the_tests(tmp_path):
    # A venv standing for the user's test environment, with a package only it has; it does not see this
    # interpreter's packages (boto3 among them), and neither may the fake AMI made from it.
    user = tmp_path / "user-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(user)], check=True, timeout=120)
    python = user / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(purelib) / "only_in_the_user_venv.py").write_text("WHERE = 'user venv'\n")
    # Inside it, build the fake AMI's Python as the emulator does, and import that package there.
    script = textwrap.dedent(f"""
        import subprocess
        from pathlib import Path
        from tests.aws.fake_ami import FakeAmi
        ami = FakeAmi(Path({str(tmp_path / "instance")!r}), "i-0a", "http://127.0.0.1:1", "us-east-1")
        code = ("import importlib.util as u, only_in_the_user_venv as m; "
                "print(m.WHERE, u.find_spec('boto3') is not None)")
        out = subprocess.run([str(ami.python), "-c", code], capture_output=True, text=True, cwd=str(ami.dir),
                             env=ami.env)
        print(out.stdout.strip() or out.stderr.strip().splitlines()[-1])
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=env, timeout=180,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "user venv False"
