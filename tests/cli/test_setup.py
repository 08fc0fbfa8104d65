"""`setup` starts one embedded etcd (idempotently) and remembers the provider; `teardown` removes it all
and refuses while a job runs unless --force, which kills the job first."""

from __future__ import annotations

import json
import ssl
import urllib.request
from pathlib import Path

from petctl.io.procs import wait_until
from tests.support.cli import Petctl, assert_one_line_error


def config(cli: Petctl) -> dict:
    return json.loads((cli.home / "config.json").read_text())


def etcd_answers(endpoint: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/v2/keys/", timeout=2, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def test_setup_is_idempotent_and_teardown_removes_everything(petctl: Petctl):
    out = petctl.run("setup").stdout
    cfg = config(petctl)
    assert cfg["provider"] == "local"
    local = cfg["settings"]["local"]
    assert local["ready"] is True
    assert local["etcd_endpoint"].startswith("https://127.0.0.1:")
    assert local["etcd_endpoint"] in out
    root = petctl.etcd_root_tls().ssl_context()
    assert etcd_answers(local["etcd_endpoint"], root)
    assert not etcd_answers(local["etcd_endpoint"])  # no client certificate: refused
    assert (petctl.home / "local" / "etcd" / "member-data").is_dir()
    assert petctl.processes() == [local["etcd_pid"]]

    petctl.run("setup")  # again: same etcd, nothing new started
    assert config(petctl)["settings"]["local"] == local
    assert petctl.processes() == [local["etcd_pid"]]
    assert petctl.json("jobs") == []

    assert "torn down" in petctl.run("teardown").stdout
    assert petctl.processes() == []
    assert not etcd_answers(local["etcd_endpoint"], root)
    assert not (petctl.home / "local").exists()
    assert not (petctl.home / "config.json").exists()  # issue 25: teardown leaves no local state
    assert "nothing to tear down" in petctl.run("teardown").stdout
    assert_one_line_error(petctl.run("jobs", check=False), "petctl setup")


def test_setup_replaces_a_dead_etcd(petctl: Petctl):
    import os
    import signal

    petctl.run("setup")
    first = config(petctl)["settings"]["local"]
    os.kill(first["etcd_pid"], signal.SIGKILL)
    petctl.run("setup")
    second = config(petctl)["settings"]["local"]
    assert second["etcd_pid"] != first["etcd_pid"]
    assert etcd_answers(second["etcd_endpoint"], petctl.etcd_root_tls().ssl_context())


def test_teardown_refuses_while_a_job_runs_unless_forced(local: Petctl, tmp_path: Path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    local.run("run_job", "--name", "busy", "--min", "2", "--max", "2", "--wait", str(script))
    # etcd, reconciler, and per node: its agent, its fork server, the worker, and the warm worker the pool
    # forked to replace it as the round formed.
    expected = 1 + 1 + 2 * 4
    assert wait_until(lambda: len(local.processes()) == expected, 10, 0.1), local.processes()
    running = local.processes()

    assert_one_line_error(local.run("teardown", check=False), "jobs still running: busy", "--force")
    assert sorted(local.processes()) == sorted(running)

    local.run("teardown", "--force")
    assert local.processes() == []
    assert not (local.home / "local").exists()
    assert not (local.home / "config.json").exists()  # issue 25: README says teardown removes local state


def test_teardown_keeps_another_providers_setup(tmp_path: Path):
    from petctl.io.config import PetctlConfig

    cfg = PetctlConfig(home=tmp_path / "home", provider="local",
                       settings={"local": {"ready": True}, "aws": {"region": "us-east-1"}})
    cfg.save()
    cfg.forget("local")
    again = PetctlConfig.load(cfg.home)
    assert (again.provider, again.settings) == ("", {"aws": {"region": "us-east-1"}})
    again.forget("aws")
    assert not cfg.path.exists() and not cfg.home.exists()


def test_run_job_with_etcd_gone_says_so_and_starts_nothing(local: Petctl, tmp_path: Path):
    import os
    import signal

    os.kill(config(local)["settings"]["local"]["etcd_pid"], signal.SIGKILL)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    proc = local.run("run_job", "--name", "orphan", "--min", "1", "--max", "1", str(script), check=False)
    assert_one_line_error(proc, "is not running", "petctl setup")
    assert not local.job_dir("orphan").exists()
    assert local.processes() == []
