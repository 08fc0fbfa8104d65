"""`petctl doctor --provider aws --probe`: the contract table as pure rules over recorded observations
(petctl/providers/aws/probe.py), one row of the table per case, and the command's refusals, which make
no AWS call. The command itself runs end to end on the emulator in tests/aws/test_probe_emulated.py."""

from __future__ import annotations

import dataclasses

import pytest

from petctl.jobview.cost import Quote, UsageKey
from petctl.providers.aws import probe
from petctl.providers.aws.probe import (
    BROKEN,
    CONTRACTS,
    EMULATOR_BLIND,
    HELD,
    NEEDS_AWS,
    NOT_REACHED,
    JobObservation,
    Observations,
    Spend,
    passed,
    render,
    stack_was_created,
    verdicts,
)

BOUNDARY = "arn:aws:iam::123456789012:policy/petctl/petctl-JobBoundary-ABC"
ASSUME = ("create stack petctl-job-probe-1: ValidationError: Role arn:aws:iam::123456789012:role/"
          "JobStackRole is invalid or cannot be assumed")
PASS_ROLE = ("stack petctl-job-probe-1 ended ROLLBACK_COMPLETE: WorkerInstanceProfile: User: arn:aws:sts::1:"
             "assumed-role/JobStackRole/x is not authorized to perform: iam:PassRole")


def all_held(emulated: bool = False) -> Observations:
    """What the probe records on an account where every contract holds."""
    good = JobObservation("probe-abc", submitted=True, created=True, boundary=BOUNDARY, in_service=True,
                          joined=1, state="succeeded", last_step=probe.STEPS - 1,
                          env={"home": "/var/lib/petctl", "cache_error": "", "nofile": 1048576,
                               "nofile_hard": 1048576, "requirement": "tqdm 4.70.1"},
                          detach_own="allowed", detach_other="implicitDeny", deletion="DELETE_COMPLETE")
    bad = JobObservation("probe-abc-nojoin", submitted=True, created=True, boundary=BOUNDARY,
                         boot_error="cannot install petctl and the job's requirements into /opt/pytorch/bin",
                         state="failed", reason="3 boots in a row never joined: cannot install ...",
                         sizes=(0, 0, 0), deletion="DELETE_COMPLETE")
    return Observations(emulated=emulated, expected_boundary=BOUNDARY, good=good, bad=bad, cleaned=True)


def table(o: Observations) -> dict[str, tuple[str, str]]:
    return {v.contract: (v.status, v.detail) for v in verdicts(o)}


def change(o: Observations, job: str = "", **fields) -> Observations:
    if job:
        return dataclasses.replace(o, **{job: dataclasses.replace(getattr(o, job), **fields)})
    return dataclasses.replace(o, **fields)


def test_every_contract_has_a_row_in_order_and_all_hold_on_a_good_account():
    rows = verdicts(all_held())
    assert [v.contract for v in rows] == [name for name, _ in CONTRACTS]
    assert {v.contract: v.status for v in rows} == dict.fromkeys(table(all_held()), HELD)
    assert passed(rows)


def test_a_template_url_cloudformation_cannot_read_breaks_its_contract_with_awss_error():
    """Issue 44.8: job stacks go by TemplateURL from the private bucket, read with the caller's rights."""
    error = "create stack probe: TemplateURL must reference a valid S3 object to which you have access."
    rows = table(change(all_held(), "good", created=False, create_error=error))
    assert rows["template by URL"] == (BROKEN, error)
    assert table(all_held())["template by URL"][0] == HELD


def test_an_instance_that_never_joined_and_recorded_no_failure_may_not_have_fetched_its_boot_script():
    rows = table(change(all_held(), "good", joined=0, in_service=False, state="", last_step=-1,
                        timed_out="no instance joined within 1800 s"))
    status, detail = rows["boot script from the bucket"]
    assert status == BROKEN and "console output" in detail
    rows = table(change(all_held(), "good", joined=0, boot_error="cannot install petctl", state="failed"))
    assert rows["boot script from the bucket"][0] == NOT_REACHED  # it ran: its own boot said why it failed
    assert table(all_held())["boot script from the bucket"][0] == HELD


def test_on_the_emulator_what_it_cannot_show_needs_aws_and_says_what_it_saw():
    rows = table(all_held(emulated=True))
    assert {name for name, (status, _) in rows.items() if status == NEEDS_AWS} == set(EMULATOR_BLIND)
    assert {name for name, (status, _) in rows.items() if status == HELD} == {
        "job role boundary", "probe job trains", "boot breaker", "nothing left behind"}
    status, detail = rows["launch hook CONTINUE"]
    assert detail.startswith("the emulator has no lifecycle hooks (seen here: ")
    assert passed(verdicts(all_held(emulated=True)))


# CloudFormation refused the role: the first job never got a stack, the second never ran.
REFUSED = dict(job="good", created=False, create_error=ASSUME, boundary="", in_service=False, joined=0,
               state="", last_step=-1, env={}, detach_own="", detach_other="", deletion="")
CASES = [
    # (what differs, the contract, its verdict, words of its detail)
    (REFUSED, "trust-policy key", BROKEN, "cannot be assumed"),
    (REFUSED, "iam:PassedToService", NOT_REACHED, "assumed"),
    (REFUSED, "probe job trains", NOT_REACHED, "assumed"),
    (REFUSED, "job role boundary", NOT_REACHED, "assumed"),
    (REFUSED, "spot notice detach", NOT_REACHED, "assumed"),
    (dict(job="good", create_error=PASS_ROLE), "trust-policy key", HELD, "as the service role"),
    (dict(job="good", create_error=PASS_ROLE), "iam:PassedToService", BROKEN, "iam:PassRole"),
    (dict(job="good", joined=0, in_service=False, state="", env={},
          boot_error="no AWS CLI v2 on root's PATH (found: aws-cli/1.18)"),
     "pip and the CLI on the DLAMI", BROKEN, "no AWS CLI v2"),
    (dict(job="good", env={"home": "/var/lib/petctl", "cache_error": "PermissionError: [Errno 13]",
                           "nofile": 1048576}), "HOME and the file limit", BROKEN, "Errno 13"),
    (dict(job="good", env={"home": "/h", "cache_error": "", "nofile": 1024, "nofile_hard": 524288}),
     "HOME and the file limit", BROKEN, "soft file limit 1024 (hard 524288)"),
    (dict(job="good", env={"home": "/h", "cache_error": "", "nofile": 1024, "nofile_hard": 1024}),
     "HOME and the file limit", BROKEN, "soft file limit 1024"),
    # a machine whose hard limit is below the unit's: as high as it lets the unit go
    (dict(job="good", env={"home": "/h", "cache_error": "", "nofile": 20000, "nofile_hard": 20000}),
     "HOME and the file limit", HELD, "soft file limit 20000"),
    (dict(job="good", env={"home": "/h", "cache_error": "", "nofile": 4096, "nofile_hard": 20000}),
     "HOME and the file limit", BROKEN, "soft file limit 4096"),
    (dict(job="good", env={}), "HOME and the file limit", NOT_REACHED, "reported nothing"),
    (dict(job="good", in_service=False), "launch hook CONTINUE", BROKEN, "Pending:Wait"),
    (dict(job="bad", left_waiting=("i-0abc (Pending:Wait)",)), "abandon at size 0", BROKEN, "i-0abc"),
    (dict(job="bad", submitted=False, created=False, state="", sizes=None), "abandon at size 0", NOT_REACHED,
     "did not run"),
    (dict(job="bad", deletion="stack petctl-job-probe-abc-nojoin ended DELETE_FAILED: WorkerRole: denied"),
     "deletion under the service role", BROKEN, "DELETE_FAILED"),
    (dict(job="good", detach_own="", detach_unavailable=True,
          detach_error="this endpoint does not implement IAM policy simulation (InvalidAction)"),
     "spot notice detach", NEEDS_AWS, "does not implement"),
    (dict(job="good", detach_own="implicitDeny"), "spot notice detach", BROKEN, "implicitDeny"),
    (dict(job="good", detach_other="allowed"), "spot notice detach", BROKEN, "another job's group"),
    (dict(job="good", detach_own="", detach_error="cannot simulate: AccessDenied: no"), "spot notice detach",
     NOT_REACHED, "AccessDenied"),
    (dict(job="good", boundary=""), "job role boundary", BROKEN, "no permissions boundary"),
    (dict(job="good", boundary=BOUNDARY + "2"), "job role boundary", BROKEN, "not the base stack's"),
    (dict(job="good", last_step=20), "probe job trains", BROKEN, "21 of 50 steps"),
    (dict(job="good", state="failed", reason="max_restarts exceeded"), "probe job trains", BROKEN,
     "max_restarts"),
    (dict(job="good", state="", timed_out="job probe-abc did not end within 30 minutes"), "probe job trains",
     BROKEN, "did not end"),
    (dict(job="bad", state="", sizes=None, timed_out="the boot breaker did not end job x within 45 minutes"),
     "boot breaker", BROKEN, "did not end"),
    (dict(job="bad", reason="petctl kill_job"), "boot breaker", BROKEN, "kill_job"),
    (dict(leftovers=["stack petctl-job-probe-abc (DELETE_FAILED)", "3 S3 key(s) under s3://b/jobs/x/"]),
     "nothing left behind", BROKEN, "DELETE_FAILED"),
    (dict(cleaned=False), "nothing left behind", NOT_REACHED, "clean-up"),
]


@pytest.mark.parametrize(("changes", "contract", "status", "words"), CASES,
                         ids=[f"{c[1]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_contract_table(changes, contract, status, words):
    changes = dict(changes)
    observed = change(all_held(), changes.pop("job", ""), **changes)
    got, detail = table(observed)[contract]
    assert (got, words in detail) == (status, True), detail
    assert not passed(verdicts(observed)) or status in (HELD, NEEDS_AWS)


def test_broken_stays_broken_on_the_emulator():
    observed = change(all_held(emulated=True), "good", in_service=False)
    assert table(observed)["launch hook CONTINUE"][0] == BROKEN


def test_a_creation_error_says_whether_the_stack_existed():
    assert stack_was_created(PASS_ROLE)
    assert not stack_was_created(ASSUME)
    assert not stack_was_created("job 'probe-1' already exists")


def test_render_prints_a_row_per_contract_then_time_and_dollars():
    lines = render(verdicts(all_held()), 754.2, Spend(0.5, 0.0123, "estimate"))
    assert lines[0].split() == ["contract", "verdict", "detail"]
    assert len(lines) == len(CONTRACTS) + 2
    assert lines[1].startswith("trust-policy key") and "  held  " in lines[1]
    assert lines[-1] == "elapsed 12m34s; 0.500 instance-hours, $0.0123 (estimate)"
    unpriced = render(verdicts(all_held()), 5, Spend(0.0, None))[-1]
    assert unpriced == "elapsed 0m05s; 0.000 instance-hours, unknown"


def test_spend_is_instance_hours_times_the_quoted_price():
    class Prices:
        def quote(self, key, start, end):
            return Quote(0.02 if key.market == "spot" else None, True, "spot price history")

        def on_demand(self, instance_type):
            return Quote(0.0416, False, "price list")

    spans = [(UsageKey("t3.medium", "spot", "us-east-1a"), 0.0, 1800.0),
             (UsageKey("t3.medium", "spot", "us-east-1a"), 100.0, 1900.0)]
    cost = probe.spend(spans, Prices())
    assert cost.hours == pytest.approx(1.0) and cost.dollars == pytest.approx(0.02)


# --- the command's refusals: one line, non-zero, nothing made (no AWS call at all) ------------------------
@pytest.fixture
def cli_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PETCTL_HOME", str(tmp_path / "home"))
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # a call would fail, not reach AWS
    return tmp_path


@pytest.mark.parametrize(("args", "message"), [
    (["--probe", "--provider", "local"], "--probe is for `--provider aws` (not local)"),
    (["--probe"], "--probe is for `--provider aws` (not local)"),  # nothing configured
    (["--instance-type", "t3.medium"], "--instance-type is for `doctor --probe`"),
    (["--probe", "--provider", "aws", "--instance-type", "z1x.large"], "unknown instance family 'z1x'"),
    (["--probe", "--provider", "aws", "--instance-type", "nonsense"], "invalid instance type 'nonsense'"),
    (["--probe", "--provider", "aws"], "petctl is not set up on AWS: run `petctl setup --provider aws"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(cli_home, capsys, args, message):
    from petctl.cli.group import main

    with pytest.raises(SystemExit) as ended:
        main(["doctor", *args])
    assert ended.value.code != 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_the_probe_job_ships_with_petctl_with_one_requirement_each():
    from petctl.providers.aws.boot import read_requirements

    files = probe.probe_files()
    assert "from petctl.elastic import" in (files / "train.py").read_text()
    assert "Path.home()" in (files / "train.py").read_text()  # ~/.cache
    for name in ("requirements.txt", "unbootable.txt"):
        text = read_requirements(files / name)  # run_job's own check passes them
        assert len([line for line in text.splitlines() if line and not line.startswith("#")]) == 1, name
    setup_py = (files.parents[2] / "setup.py").read_text()
    assert '"petctl._templates": ["probe/*"]' in setup_py  # package data: installed petctl has them too


def test_the_probe_script_trains_50_steps_writes_its_cache_and_reports(tmp_path):
    """The packaged script as a worker runs it (torchrun's environment, one process), with a HOME of its
    own: the `probe.env` line the probe reads, 50 `train.step` lines, a checkpoint, the cache file."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("torch")
    repo = probe.probe_files().parents[2]
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1",
           "PETCTL_CHECKPOINT_URL": (tmp_path / "checkpoints").as_uri(), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(probe.probe_files() / "train.py")]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    (report,) = [e for e in events if e["event"] == "probe.env"]
    assert report["cache_error"] == "" and report["home"] == str(tmp_path / "home")
    assert report["nofile"] > 0 and report["requirement"].startswith("tqdm ")
    assert [e["step"] for e in events if e["event"] == "train.step"] == list(range(probe.STEPS))
    assert (tmp_path / "home" / ".cache" / "petctl-probe" / "0.txt").read_text() == "probe\n"
    assert any(p.is_file() for p in (tmp_path / "checkpoints").rglob("*"))
