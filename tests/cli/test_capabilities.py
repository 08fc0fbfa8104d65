"""The CLI against a provider of the test's own, handed in through the CLI's context (no setup, no
etcd): what a provider lacks is checked, not sniffed, and refused in one line naming the provider;
`status` shows what the read side found, counted failures and skipped records included."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from petctl.cli.context import CliContext
from petctl.cli.group import main
from petctl.io.config import PetctlConfig
from petctl.jobview.prefix import file_prefix
from petctl.jobview.view import JobSources
from petctl.providers.aws.provider import AwsProvider
from petctl.providers.base import JobInfo, Provider
from petctl.providers.capabilities import CapacityInsight, Chaos, Diagnostics, Pricing, check_chaos_mode
from petctl.providers.local.provider import LocalProvider


class BareProvider(Provider):
    """Capacity only: no chaos, no prices, no checks. Its one job's records are a mirror directory."""

    name = "bare"

    def __init__(self, home: Path) -> None:
        super().__init__(PetctlConfig(home=home))
        self.mirror = home / "mirror"
        self.created: list[Any] = []

    def setup(self, **options: Any) -> dict[str, Any]:
        return {}

    def teardown(self, force: bool = False) -> None:
        pass

    def create_job(self, job) -> JobInfo:
        self.created.append(job)
        return self.job(job.spec.name)

    def kill_job(self, name: str) -> None:
        pass

    def scale(self, name: str, size: int) -> None:
        pass

    def hosts(self, name: str):
        return []

    def jobs(self) -> list[JobInfo]:
        return [self.job("demo")]

    def job(self, name: str) -> JobInfo:
        return JobInfo(name=name, state="running", min_size=1, max_size=3, desired=2, created_at=0.0,
                       provider=self.name)

    def sources(self, name: str) -> JobSources:
        return JobSources(job=name, mirror=file_prefix(self.mirror))


def run(provider: Provider, capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args), obj=CliContext(provider=provider))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def write_status(mirror: Path, node: str, **fields: Any) -> None:
    (mirror / "status").mkdir(parents=True, exist_ok=True)
    record = {"node_id": node, "state": "running", "updated": 1.0, "round": 2, "world_size": 2, **fields}
    (mirror / "status" / f"{node}.json").write_text(json.dumps(record))


def test_capabilities_are_declared_by_what_a_provider_implements(tmp_path: Path) -> None:
    local, aws = LocalProvider(PetctlConfig(home=tmp_path)), AwsProvider(PetctlConfig(home=tmp_path))
    assert [isinstance(local, c) for c in (Chaos, Pricing, Diagnostics, CapacityInsight)] == [
        True, False, False, False]
    assert all(isinstance(aws, c) for c in (Chaos, Pricing, Diagnostics, CapacityInsight))
    assert not any(isinstance(BareProvider(tmp_path), c) for c in (Chaos, Pricing, Diagnostics,
                                                                   CapacityInsight))
    with pytest.raises(Exception, match="chaos mode 'freeze' is not supported on aws: only kill"):
        check_chaos_mode(aws, "freeze")
    assert check_chaos_mode(local, "freeze") is local


def test_a_missing_capability_is_one_line_naming_the_provider(tmp_path: Path, capsys) -> None:
    code, out, err = run(BareProvider(tmp_path), capsys, "chaos", "demo", "--kill")
    assert code == 4 and out == ""
    assert err == "error: the bare provider cannot take instances away (chaos)\n"
    code, out, _ = run(BareProvider(tmp_path), capsys, "doctor")
    assert code == 0 and out == "SKIP provider: no checks for the bare provider\n"


def test_run_job_refuses_an_option_the_provider_does_not_declare(tmp_path: Path, capsys) -> None:
    provider = BareProvider(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["run_job", "--name", "demo", "--min", "1", "--max", "2", str(script)]
    code, _, err = run(provider, capsys, *base[:-1], "--replace-delay", "1", base[-1])
    assert code == 2 and err == "error: --replace-delay is not supported by the bare provider\n"
    code, _, err = run(provider, capsys, *base[:-1], "--instance-type", "g5.xlarge", base[-1])
    assert code == 2 and err == "error: --instance-type is not supported by the bare provider\n"
    assert provider.created == []
    code, out, _ = run(provider, capsys, *base)
    assert code == 0 and "job demo started" in out
    (job,) = provider.created
    assert job.spec.entrypoint == "train.py" and job.spec.timeouts.heartbeat_ttl == 3.0


def test_status_shows_counted_failures_and_skipped_records(tmp_path: Path, capsys) -> None:
    provider = BareProvider(tmp_path)
    write_status(provider.mirror, "i-a", rank=0, failures={"mirror": 3, "heartbeat": 0})
    write_status(provider.mirror, "i-b", rank=1)
    (provider.mirror / "status" / "i-c.json").write_text('{"node_id": "i-c", "sta')  # torn write
    code, out, _ = run(provider, capsys, "status", "demo", "-o", "json")
    data = json.loads(out)
    assert code == 0 and data["source"] == "mirror" and data["ranks"] == {"i-a": 0, "i-b": 1}
    assert data["nodes"]["i-a"]["failures"] == {"mirror": 3, "heartbeat": 0}
    assert data["corrupt_records"] == {"node status": 1}
    code, out, _ = run(provider, capsys, "status", "demo")
    header = next(line for line in out.splitlines() if "rank" in line and "node" in line)
    assert code == 0 and "failures" in header
    assert "mirror=3" in out and "heartbeat=0" not in out  # counted failures only
    assert "note: skipped 1 corrupt record(s) (node status: 1)" in out
    write_status(provider.mirror, "i-a", rank=0)
    (provider.mirror / "status" / "i-c.json").unlink()
    code, out, _ = run(provider, capsys, "status", "demo")
    assert code == 0 and "failures" not in out and "note:" not in out  # no column when none counted


def test_commands_never_import_the_group() -> None:
    """The commands get their provider from petctl.cli.context: the group imports them, never the
    reverse."""
    cli_dir = Path(__file__).resolve().parents[2] / "petctl" / "cli"
    for path in cli_dir.glob("*.py"):
        if path.name in ("group.py", "__init__.py"):
            continue
        imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom)}
        assert "petctl.cli.group" not in imported and "petctl.cli" not in imported, path.name
