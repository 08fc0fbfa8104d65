"""The CLI's shell: fast to start, one-line errors, nothing works (or is left) before `setup`."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.support.cli import Petctl, assert_one_line_error


def test_import_keeps_heavy_modules_out():
    code = ("import sys, petctl.cli; "
            "print(','.join(m for m in ('boto3', 'torch', 'etcd', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_help_is_fast_and_lists_every_command(petctl: Petctl):
    start = time.monotonic()
    out = petctl.run("--help").stdout
    assert time.monotonic() - start < 5
    for command in ("setup", "teardown", "run_job", "kill_job", "jobs", "status", "hosts", "logs", "scale",
                    "chaos"):
        assert command in out


def test_usage_errors_are_one_line(petctl: Petctl):
    assert_one_line_error(petctl.run("no-such-command", check=False), "no-such-command")
    assert_one_line_error(petctl.run("run_job", "--min", "1", "--max", "2", "x.py", check=False), "--name")
    assert_one_line_error(petctl.run("run_job", "--name", "a1", "--min", "one", "--max", "2", "x.py",
                                     check=False), "--min")


def test_nothing_works_before_setup(petctl: Petctl, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    proc = petctl.run("run_job", "--name", "job1", "--min", "1", "--max", "2", str(script), check=False)
    assert_one_line_error(proc, "petctl setup")
    for args in (["jobs"], ["status", "job1"], ["kill_job", "job1"], ["scale", "job1", "--size", "1"]):
        assert_one_line_error(petctl.run(*args, check=False), "petctl setup")
    assert not (petctl.home / "local").exists()
    assert petctl.processes() == []


def test_teardown_without_setup_is_a_no_op(petctl: Petctl):
    assert "nothing to tear down" in petctl.run("teardown").stdout


def test_console_script_entry_point_exits_cleanly(capsys):
    import pytest

    import petctl.cli.group  # noqa: F401 - imported first, as the in-process tests do: no name clash
    from petctl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("petctl ")
