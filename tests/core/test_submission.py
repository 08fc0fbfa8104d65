"""The one validation of a submitted job (`JobSubmission.validate`): what it refuses, with which
one-line message, what it settles, and which provider-specific options each provider accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from petctl.core.errors import ValidationError
from petctl.core.spec import PROVIDER_OPTIONS, JobSpec, JobSubmission
from petctl.providers.aws.provider import AwsProvider
from petctl.providers.local.provider import LocalProvider


def spec(**kw) -> JobSpec:
    return JobSpec(**{"name": "demo", "min_size": 1, "max_size": 4, "size": 2, "entrypoint": "", **kw})


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


@pytest.mark.parametrize("kw, needle", [
    ({"name": "Bad_Name"}, "invalid job name 'Bad_Name'"),
    ({"min_size": 0}, "--min must be >= 1 (got 0)"),
    ({"min_size": 3, "max_size": 2, "size": 2}, "--min (3) is greater than --max (2)"),
    ({"size": 5}, "--size 5 is outside [--min 1, --max 4]"),
    ({"nproc_per_node": 0}, "--nproc-per-node must be >= 1 (got 0)"),
    ({"max_restarts": -1}, "--max-restarts must be >= 0 (got -1)"),
    ({"spot_strategy": "cheapest"}, "unknown spot allocation strategy 'cheapest'"),
    ({"on_demand_base": 9}, "--on-demand-base 9 is outside [0, --max 4]"),
])
def test_bad_specs_are_refused_with_one_line(script: Path, kw: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        JobSubmission(spec(**kw), script).validate()
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_script_and_entrypoint(tmp_path: Path, script: Path) -> None:
    with pytest.raises(ValidationError, match="script not found: .*nope.py"):
        JobSubmission(spec(), tmp_path / "nope.py").validate()
    code = tmp_path / "code"
    code.mkdir()
    with pytest.raises(ValidationError, match="is a directory: name the file to run with --entrypoint"):
        JobSubmission(spec(), code).validate()
    with pytest.raises(ValidationError, match="entrypoint 'main.py' not found in"):
        JobSubmission(spec(entrypoint="main.py"), code).validate()
    with pytest.raises(ValidationError, match="--entrypoint is only for a directory SCRIPT"):
        JobSubmission(spec(entrypoint="other.py"), script).validate()
    (code / "main.py").write_text("")
    assert JobSubmission(spec(entrypoint="main.py"), code).validate().spec.entrypoint == "main.py"
    # A file is its own entrypoint; validating again (the provider after the CLI) changes nothing.
    job = JobSubmission(spec(), script).validate()
    assert job.spec.entrypoint == "train.py" and job.validate().spec.entrypoint == "train.py"


def test_replace_delay_must_not_be_negative(script: Path) -> None:
    with pytest.raises(ValidationError, match=r"--replace-delay must be >= 0 \(got -1"):
        JobSubmission(spec(), script, replace_delay=-1).validate()


def test_options_set_lists_only_what_differs_from_the_defaults(script: Path) -> None:
    assert JobSubmission(spec(), script).options_set() == []
    job = JobSubmission(spec(instance_types=["g5.xlarge"], multi_az=True), script, replace_delay=0.0)
    assert job.options_set() == ["replace_delay", "instance_types", "multi_az"]
    assert set(PROVIDER_OPTIONS) == LocalProvider.run_options | AwsProvider.run_options  # all declared


@pytest.mark.parametrize("provider, job_kw, sub_kw, needle", [
    (LocalProvider, {"instance_types": ["g5.xlarge"]}, {}, "--instance-type is not supported by the local "
                                                           "provider"),
    (LocalProvider, {"on_demand": True, "multi_az": True}, {}, "--on-demand, --multi-az are not supported"),
    (AwsProvider, {}, {"replace_delay": 2.0}, "--replace-delay is not supported by the aws provider"),
])
def test_each_provider_refuses_options_it_does_not_honour(script, provider, job_kw, sub_kw, needle) -> None:
    job = JobSubmission(spec(**job_kw), script, **sub_kw)
    job.validate()  # valid in itself: only the provider can say it does not honour the option
    with pytest.raises(ValidationError, match=needle):
        job.validate(provider.name, provider.run_options)


def test_each_provider_accepts_its_own_options(script: Path) -> None:
    JobSubmission(spec(), script, replace_delay=0.5).validate("local", LocalProvider.run_options)
    aws = JobSubmission(spec(instance_types=["g5.xlarge"], on_demand=True, on_demand_base=1,
                             spot_strategy="capacity-optimized", multi_az=True), script)
    aws.validate("aws", AwsProvider.run_options)


def test_local_provider_warns_when_torch_is_missing() -> None:
    """`pip install petctl` has no torch; the local provider runs the script here, so it says so."""
    from petctl.providers.local.provider import torch_warning

    assert torch_warning(lambda name: object()) is None
    warning = torch_warning(lambda name: None)
    assert warning is not None and "petctl[elastic]" in warning and "\n" not in warning
