"""`petctl doctor --provider aws --probe`: what only an AWS account can settle, settled by running two
small jobs on it, then a table of every contract, each `held`, `broken` (with AWS's error), `needs AWS`
(an emulator cannot show it) or `not reached` (an earlier step failed, or the probe was stopped).

The probe sets up nothing beyond its jobs; it needs a finished `petctl setup --provider aws`.

1. A one-node job on a small CPU instance (`--instance-type`, DEFAULT_TYPE), from the Deep Learning AMI
   like any default job: `petctl/_templates/probe/train.py` trains 50 steps through `petctl.elastic`,
   writes to `~/.cache`, reports its file limit, and imports the one requirement its instance installed.
2. At the same time, a second one-node job whose requirement no index can satisfy: each boot fails, the
   launch is abandoned, the group launches the next, and the third failure trips the boot breaker
   (petctl/core/boots.py), which sets the group to 0 and ends the job `failed`.
3. While each job stands: its role's permissions boundary (IAM GetRole) and, for the first, whether the
   role may detach instances from its own group and from no other (IAM SimulatePrincipalPolicy).
4. Both stacks are deleted as every job's is (the base stack's service role) and must end
   DELETE_COMPLETE; the jobs' S3 prefixes and etcd credentials go too. All of it also runs after Ctrl-C,
   SIGTERM or a failure, and the table then says what was not reached.

The decisions are pure functions over what was observed (`Observations` -> `verdicts`), so every rule
is table-tested without AWS; `run` is the edge that makes the calls and records the observations.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from petctl.core.boots import BREAKER_LIMIT
from petctl.core.errors import JobNotFound, PetctlError

if TYPE_CHECKING:
    from petctl.providers.aws.context import AwsContext

HELD, BROKEN, NEEDS_AWS, NOT_REACHED = "held", "broken", "needs AWS", "not reached"
# The cheapest x86_64 type with the 4 GiB that pip and `import torch` need; the Deep Learning AMI (GPU)
# boots on CPU types too (its NVIDIA driver just finds no GPU).
DEFAULT_TYPE = "t3.medium"
STEPS = 50
STEP_SECONDS = 1.0  # per step: the instance stays InService long enough to be seen there
# The agent's unit sets LimitNOFILE=1048576; without it systemd's default soft limit, 1024, is what the
# workers get ("Too many open files" in DataLoader and NCCL). The soft limit must be the unit's, or as high as
# the machine's hard limit lets it be, and above systemd's default.
NOFILE_WANTED = 1048576
SYSTEMD_DEFAULT_NOFILE = 1024
GOOD_TIMEOUT = 30 * 60.0  # seconds for the first job to finish (a DLAMI boot is 3-8 minutes)
BAD_TIMEOUT = 45 * 60.0  # seconds for the breaker: BREAKER_LIMIT boots, one after another
EMPTY_TIMEOUT = 10 * 60.0  # seconds for a group at 0 to have no instance left
POLL = 2.0

# name, what it settles (the table's second column)
CONTRACTS = (
    ("trust-policy key", "CloudFormation can assume the job stacks' service role"),
    ("template by URL", "CloudFormation reads the job's template from the private bucket (TemplateURL)"),
    ("iam:PassedToService", "the service role adds the job role to its instance profile (PassRole to EC2)"),
    ("pip and the CLI on the DLAMI", "the boot installs petctl and one requirement; AWS CLI v2 on PATH"),
    ("boot script from the bucket", "the user data fetches its boot script with the instance role"),
    ("HOME and the file limit", "the worker writes ~/.cache; its soft file limit is high"),
    ("launch hook CONTINUE", "a joined instance leaves Pending:Wait for InService"),
    ("abandon at size 0", "the boot breaker's group at 0 keeps no instance waiting"),
    ("deletion under the service role", "both job stacks delete to DELETE_COMPLETE"),
    ("spot notice detach", "autoscaling:DetachInstances on the job's own group, no other"),
    ("job role boundary", "the job role carries the base stack's permissions boundary"),
    ("probe job trains", f"{STEPS} steps through petctl.elastic, then the job succeeds"),
    ("boot breaker", f"{BREAKER_LIMIT} boots that never join end the job with its group at 0"),
    ("nothing left behind", "no stack, group, instance, S3 key or secret of the probe remains"),
)
# What an emulator (moto) cannot show: there a contract that held reads "needs AWS", and why.
EMULATOR_BLIND = {
    "trust-policy key": "the emulator assumes no role",
    "template by URL": "the emulator reads a TemplateURL without checking the caller's access",
    "boot script from the bucket": "the emulator checks no instance role's access",
    "iam:PassedToService": "the emulator evaluates no IAM condition",
    "pip and the CLI on the DLAMI": "the emulator runs no Deep Learning AMI",
    "HOME and the file limit": "the emulator's workers are this machine's processes",
    "launch hook CONTINUE": "the emulator has no lifecycle hooks",
    "abandon at size 0": "the emulator has no lifecycle hooks: no instance waits",
    "deletion under the service role": "the emulator deletes with no role",
    "spot notice detach": "the emulator has no IAM policy simulation",
}


def probe_files() -> Path:
    """The probe job's code and requirements, shipped with petctl (setup.py's package data)."""
    return Path(__file__).resolve().parents[2] / "_templates" / "probe"


# --- what was observed ----------------------------------------------------------------------------------
@dataclass
class JobObservation:
    """One probe job as the probe saw it. Empty fields: not observed (never got that far)."""

    name: str
    submitted: bool = False
    created: bool = False  # its stack was created (CloudFormation assumed the service role)
    create_error: str = ""
    boundary: str = ""  # its role's PermissionsBoundary ARN
    role_error: str = ""
    in_service: bool = False  # one of its instances was seen InService
    joined: int = 0  # instances whose agent joined the rendezvous
    boot_error: str = ""  # the newest failed boot's error
    state: str = ""  # its end (result.json): succeeded, failed, killed; "" when it did not end
    reason: str = ""
    timed_out: str = ""  # what it waited for in vain
    last_step: int = -1
    env: dict[str, Any] = field(default_factory=dict)  # the probe script's `probe.env` line
    sizes: tuple[int, int, int] | None = None  # its group's (min, max, desired) at its end
    left_waiting: tuple[str, ...] = ()  # "<instance> (<lifecycle state>)" still in its group at 0
    detach_own: str = ""  # IAM's decision for DetachInstances on its own group ("allowed", ...)
    detach_other: str = ""  # ... and on another group
    detach_error: str = ""  # why it could not be simulated
    detach_unavailable: bool = False  # the endpoint has no IAM policy simulation
    deletion: str = ""  # its stack's status after deletion, or the deletion's error


@dataclass
class Observations:
    emulated: bool
    expected_boundary: str
    good: JobObservation
    bad: JobObservation
    leftovers: list[str] = field(default_factory=list)
    cleaned: bool = False
    stopped: str = ""  # why the probe stopped early (Ctrl-C, an error)
    interrupted: bool = False  # by Ctrl-C, SIGTERM or SIGHUP (the CLI exits 130 after the table)


@dataclass(frozen=True)
class Verdict:
    contract: str
    status: str
    detail: str


@dataclass(frozen=True)
class Spend:
    hours: float
    dollars: float | None
    note: str = ""


# --- the decisions (pure) -------------------------------------------------------------------------------
_CREATED = re.compile(r"^stack \S+ ended ")  # StackOps.wait: the stack existed and its creation failed
_ASSUME = re.compile(r"cannot be assumed|AssumeRole|not authorized to perform: sts", re.I)
_PASS = re.compile(r"PassRole|PassedToService|AddRoleToInstanceProfile|InstanceProfile", re.I)
_TEMPLATE_URL = re.compile(r"TemplateURL|valid S3 object|S3 error", re.I)


def stack_was_created(error: str) -> bool:
    """Whether a creation error came after CloudFormation created the stack (it assumed the role and
    worked on resources), not from CreateStack itself."""
    return bool(_CREATED.match(error))


def _why_not(job: JobObservation, stopped: str) -> str:
    return job.create_error or job.timed_out or stopped or "an earlier step did not complete"


def trust(o: Observations) -> tuple[str, str]:
    job = o.good
    if job.create_error and _ASSUME.search(job.create_error) and not job.created:
        return BROKEN, job.create_error
    if job.created:
        return HELD, f"CloudFormation created job {job.name}'s stack as the service role"
    return NOT_REACHED, _why_not(job, o.stopped)


def template_by_url(o: Observations) -> tuple[str, str]:
    job = o.good
    if job.create_error and _TEMPLATE_URL.search(job.create_error):
        return BROKEN, job.create_error
    if job.created:
        return HELD, f"job {job.name}'s stack was created from its template in the bucket"
    return NOT_REACHED, _why_not(job, o.stopped)


def boot_fetch(o: Observations) -> tuple[str, str]:
    """An instance whose agent joined ran the boot script its user data fetched. One that never joined
    and recorded no failed boot may not have fetched it (the stub's failure has no boot record)."""
    job = o.good
    if job.joined:
        return HELD, "the instance fetched its boot script, checked its SHA-256 and ran it"
    if job.timed_out and not job.boot_error:
        return BROKEN, (f"{job.timed_out}, with no failed boot recorded: see the instance's console output "
                        "for the user data's fetch of its boot script")
    return NOT_REACHED, _why_not(job, o.stopped)


def passed_to_service(o: Observations) -> tuple[str, str]:
    job = o.good
    if job.create_error and _PASS.search(job.create_error):
        return BROKEN, job.create_error
    if job.created and not job.create_error:
        return HELD, "the job's instance profile took its role"
    return NOT_REACHED, _why_not(job, o.stopped)


def dlami(o: Observations) -> tuple[str, str]:
    job = o.good
    if job.joined:
        requirement = job.env.get("requirement", "")
        return HELD, "petctl installed and its agent joined" + (f"; {requirement}" if requirement else "")
    if job.boot_error:
        return BROKEN, job.boot_error
    return NOT_REACHED, _why_not(job, o.stopped)


def home(o: Observations) -> tuple[str, str]:
    env = o.good.env
    if not env:
        return NOT_REACHED, "the probe script reported nothing" + (
            f" ({_why_not(o.good, o.stopped)})" if _why_not(o.good, o.stopped) else "")
    problems = []
    if env.get("cache_error"):
        problems.append(f"~/.cache: {env['cache_error']}")
    nofile, hard = int(env.get("nofile") or 0), int(env.get("nofile_hard") or 0)
    if nofile <= SYSTEMD_DEFAULT_NOFILE or nofile < min(NOFILE_WANTED, hard or NOFILE_WANTED):
        problems.append(f"soft file limit {nofile} (hard {hard}), not the unit's {NOFILE_WANTED}")
    if problems:
        return BROKEN, "; ".join(problems)
    return HELD, f"wrote {env.get('home', '~')}/.cache; soft file limit {nofile}"


def launch_hook(o: Observations) -> tuple[str, str]:
    job = o.good
    if job.joined and job.in_service:
        return HELD, "the instance went InService after its agent joined"
    if job.joined and job.state:
        return BROKEN, "the agent joined, but no instance was seen InService (still Pending:Wait?)"
    return NOT_REACHED, _why_not(job, o.stopped)


def abandon(o: Observations) -> tuple[str, str]:
    job = o.bad
    if job.sizes == (0, 0, 0) and job.left_waiting:
        return BROKEN, f"group at 0, yet still in it: {', '.join(job.left_waiting)}"
    if job.sizes == (0, 0, 0):
        return HELD, "the group at 0 let its last instance go"
    return NOT_REACHED, _why_not(job, o.stopped) if job.submitted else "the second job did not run"


def deletion(o: Observations) -> tuple[str, str]:
    created = [j for j in (o.good, o.bad) if j.created]
    if not created:
        return NOT_REACHED, "no job stack was created"
    failed = [f"{j.name}: {j.deletion or 'not deleted'}" for j in created if j.deletion != "DELETE_COMPLETE"]
    if failed:
        return BROKEN, "; ".join(failed)
    return HELD, f"{len(created)} stack(s) DELETE_COMPLETE"


def detach(o: Observations) -> tuple[str, str]:
    job = o.good
    if job.detach_unavailable:
        return NEEDS_AWS, job.detach_error or "this endpoint cannot simulate IAM policies"
    if job.detach_error:
        return NOT_REACHED, job.detach_error
    if not job.detach_own:
        return NOT_REACHED, _why_not(job, o.stopped)
    if job.detach_own != "allowed":
        return BROKEN, f"DetachInstances on its own group: {job.detach_own}"
    if job.detach_other == "allowed":
        return BROKEN, "DetachInstances is allowed on another job's group too"
    return HELD, f"allowed on its own group; another group: {job.detach_other or 'not simulated'}"


def boundary(o: Observations) -> tuple[str, str]:
    job = o.good
    if job.role_error:
        return BROKEN, job.role_error
    if not job.created:
        return NOT_REACHED, _why_not(job, o.stopped)
    if not job.boundary:
        return BROKEN, "the job role has no permissions boundary"
    if job.boundary != o.expected_boundary:
        return BROKEN, f"boundary {job.boundary}, not the base stack's {o.expected_boundary}"
    return HELD, job.boundary.rsplit("/", 1)[-1]


def trains(o: Observations) -> tuple[str, str]:
    job = o.good
    if job.state == "succeeded" and job.last_step >= STEPS - 1:
        return HELD, f"{job.last_step + 1} steps; the job succeeded"
    if job.state == "succeeded":
        return BROKEN, f"succeeded, but its logs show {job.last_step + 1} of {STEPS} steps"
    if job.state:
        return BROKEN, f"{job.state}: {job.reason}"
    if job.timed_out or job.boot_error:
        return BROKEN, job.timed_out or job.boot_error
    return NOT_REACHED, _why_not(job, o.stopped)


def breaker(o: Observations) -> tuple[str, str]:
    job = o.bad
    if not job.submitted:
        return NOT_REACHED, "the second job did not run"
    if job.state == "failed" and "never joined" in job.reason and job.sizes == (0, 0, 0):
        return HELD, job.reason
    if job.state:
        return BROKEN, f"{job.state}: {job.reason} (group {job.sizes})"
    if job.timed_out:
        return BROKEN, job.timed_out
    return NOT_REACHED, _why_not(job, o.stopped)


def left_behind(o: Observations) -> tuple[str, str]:
    if not o.cleaned:
        return NOT_REACHED, "the clean-up did not finish"
    if o.leftovers:
        return BROKEN, "; ".join(o.leftovers)
    return HELD, "clean"


RULES: dict[str, Callable[[Observations], tuple[str, str]]] = {
    "trust-policy key": trust, "template by URL": template_by_url, "iam:PassedToService": passed_to_service,
    "pip and the CLI on the DLAMI": dlami, "boot script from the bucket": boot_fetch,
    "HOME and the file limit": home,
    "launch hook CONTINUE": launch_hook, "abandon at size 0": abandon,
    "deletion under the service role": deletion, "spot notice detach": detach, "job role boundary": boundary,
    "probe job trains": trains, "boot breaker": breaker, "nothing left behind": left_behind,
}


def verdicts(o: Observations) -> list[Verdict]:
    """Every contract's verdict, in CONTRACTS' order. On an emulator a contract it cannot show reads
    `needs AWS` where it held (what the emulator did show stays in the detail); `broken` stays broken."""
    out = []
    for name, _ in CONTRACTS:
        status, detail = RULES[name](o)
        if o.emulated and name in EMULATOR_BLIND and status == HELD:
            status, detail = NEEDS_AWS, f"{EMULATOR_BLIND[name]} (seen here: {detail})"
        out.append(Verdict(name, status, detail))
    return out


def passed(results: list[Verdict]) -> bool:
    """True when nothing is broken or not reached (`needs AWS` is the emulator's limit, not a failure)."""
    return all(v.status in (HELD, NEEDS_AWS) for v in results)


def spend(spans: list[tuple[Any, float, float]], prices: Any) -> Spend:
    """Instance-hours and their dollars at the prices `prices` quotes (jobview.cost.price_usage)."""
    from petctl.jobview.cost import price_usage

    report = price_usage(spans, prices)
    hours = sum(line.hours for line in report.lines)
    return Spend(hours, report.total, report.note)


def render(results: list[Verdict], elapsed: float, cost: Spend) -> list[str]:
    """The table: one line per contract, then the time and the money."""
    width = max(len(v.contract) for v in results)
    lines = [f"{'contract':<{width}}  {'verdict':<11}  detail"]
    lines += [f"{v.contract:<{width}}  {v.status:<11}  {v.detail}" for v in results]
    minutes, seconds = divmod(int(elapsed), 60)
    money = "unknown" if cost.dollars is None else f"${cost.dollars:.4f}"
    note = f" ({cost.note})" if cost.note else ""
    lines.append(f"elapsed {minutes}m{seconds:02d}s; {cost.hours:.3f} instance-hours, {money}{note}")
    return lines


# --- the edge: AWS calls ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    instance_type: str = DEFAULT_TYPE
    token: str = field(default_factory=lambda: secrets.token_hex(3))

    @property
    def good(self) -> str:
        return f"probe-{self.token}"

    @property
    def bad(self) -> str:
        return f"probe-{self.token}-nojoin"


@contextlib.contextmanager
def _signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """`handler` for SIGINT, SIGTERM and SIGHUP while inside (main thread only: Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, handler) for s in names}
    try:
        yield
    finally:
        for s, previous in old.items():
            signal.signal(s, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(provider: AwsContext, plan: Plan, echo: Callable[[str], None]) -> tuple[Observations, Spend, float]:
    """Run the probe on `provider`'s account; returns what it observed, what it spent and how long it took.
    Raises NotSetUp before anything is made; KeyboardInterrupt (Ctrl-C, SIGTERM, SIGHUP) after it
    cleaned up."""
    settings = provider.require_ready()
    session = provider.session()
    started, wall = time.monotonic(), time.time()
    obs = Observations(emulated=bool(settings.get("endpoint_url")),
                       expected_boundary=settings["outputs"].get("JobBoundaryArn", ""),
                       good=JobObservation(plan.good), bad=JobObservation(plan.bad))
    try:
        with _signals(_interrupt):
            files = probe_files()
            echo(f"probe: job {plan.good} ({plan.instance_type}): {STEPS} steps through petctl.elastic")
            # Both jobs run at once (two small instances: within a new account's vCPU quota), so the
            # probe takes the second job's three failed boots, not the sum of both jobs.
            if _start(provider, plan, obs.good, files / "requirements.txt", echo):
                echo(f"probe: job {plan.bad}: a requirement no index has; the boot breaker must end it")
                bad = _start(provider, plan, obs.bad, files / "unbootable.txt", echo)
                _watch_good(provider, obs.good, echo)
                if bad:
                    _watch_bad(provider, obs.bad, echo)
    except KeyboardInterrupt as exc:
        obs.stopped = f"stopped by {exc.args[0] if exc.args else 'SIGINT'}"
        obs.interrupted = True
    except Exception as exc:  # noqa: BLE001 any failure: clean up, then the table says where it stopped
        what = str(exc) if isinstance(exc, PetctlError) else f"{type(exc).__name__}: {exc}"
        obs.stopped = f"stopped: {what}"
    finally:
        def hold_on(signum: int, frame: Any) -> None:
            echo("probe: cleaning up what it made; wait for it to finish")

        with _signals(hold_on):
            echo("probe: cleaning up")
            for job in (obs.good, obs.bad):
                if job.submitted:
                    job.deletion = _remove(provider, job)
            cost = _cost(provider, session, obs, wall)  # EC2 lists ended instances for about an hour
            try:
                obs.leftovers = _leftovers(provider, [j.name for j in (obs.good, obs.bad) if j.submitted])
            except Exception as exc:  # noqa: BLE001 an unanswered look is a leftover not ruled out
                obs.leftovers = [f"could not look for leftovers: {type(exc).__name__}: {exc}"]
            obs.cleaned = True
    if obs.interrupted:
        echo(obs.stopped)
    return obs, cost, time.monotonic() - started


def _start(provider: AwsContext, plan: Plan, job: JobObservation, requirements: Path, echo) -> bool:
    """Submit one probe job as `run_job` does; records whether its stack was created, its role's
    boundary and (for the first) its detach permission. False when it did not start."""
    from petctl.core.spec import JobSpec, JobSubmission

    timeouts = provider.default_timeouts()
    spec = JobSpec(name=job.name, min_size=1, max_size=1, size=1, entrypoint="",
                   env={"PROBE_STEPS": str(STEPS), "PROBE_STEP_SECONDS": str(STEP_SECONDS)},
                   instance_types=[plan.instance_type], timeouts=timeouts)
    submission = JobSubmission(spec, probe_files() / "train.py", requirements=requirements).validate()
    job.submitted = True  # from here on the clean-up looks for what it may have left
    try:
        provider.create_job(provider.validate(submission))
    except PetctlError as exc:
        job.create_error, job.created = str(exc), stack_was_created(str(exc))
        echo(f"probe: job {job.name} did not start: {exc}")
        return False
    job.created = True
    _read_role(provider, job, detach=job.name == plan.good)
    return True


def _read_role(provider: AwsContext, job: JobObservation, detach: bool) -> None:
    from petctl.io.aws import ClientError, ResponseParserError, error_code, error_message
    from petctl.providers.aws import inventory
    from petctl.providers.aws.doctor import _unavailable

    session = provider.session()
    stack = provider.job_stack(job.name)
    try:
        resource = session.client("cloudformation").describe_stack_resource(
            StackName=stack, LogicalResourceId="WorkerRole")["StackResourceDetail"]
        role = session.client("iam").get_role(RoleName=resource["PhysicalResourceId"])["Role"]
    except (ClientError, ResponseParserError) as exc:
        job.role_error = f"cannot read the job role: {error_code(exc)}: {error_message(exc)[:200]}"
        return
    job.boundary = (role.get("PermissionsBoundary") or {}).get("PermissionsBoundaryArn", "")
    if not detach:
        return
    group_arn = inventory.group(session.client("autoscaling"), stack, job.name).get("AutoScalingGroupARN", "")
    other = f"{group_arn.rsplit('/', 1)[0]}/{provider.job_stack('another-job')}"
    iam = session.client("iam", profile="probe")
    try:
        for resource_arn, slot in ((group_arn, "detach_own"), (other, "detach_other")):
            result = iam.simulate_principal_policy(PolicySourceArn=role["Arn"],
                                                   ActionNames=["autoscaling:DetachInstances"],
                                                   ResourceArns=[resource_arn])["EvaluationResults"]
            setattr(job, slot, result[0]["EvalDecision"] if result else "no result")
    except (ClientError, ResponseParserError, NotImplementedError) as exc:
        job.detach_unavailable = _unavailable(exc)
        code = error_code(exc) or type(exc).__name__
        job.detach_error = (f"this endpoint does not implement IAM policy simulation ({code})"
                            if job.detach_unavailable else
                            f"cannot simulate: {code}: {error_message(exc)[:200]}")


def _look(provider: AwsContext, job: JobObservation, shown: dict[str, str], echo) -> dict[str, Any] | None:
    """One look at a job: its group (None once gone), its boots, its result. Records what it saw."""
    from petctl.jobview.live import mirror_result
    from petctl.providers.aws import inventory

    session = provider.session()
    try:
        group = inventory.group(session.client("autoscaling"), provider.job_stack(job.name), job.name)
    except JobNotFound:
        group = None
    if group is not None:
        job.in_service |= any(i.get("LifecycleState") == "InService" for i in group.get("Instances", []))
    store = provider.store(session, job.name)
    report = inventory.report(store, group)
    for instance, stage in sorted(report.stages.items()):
        if shown.get(instance) != stage:
            shown[instance] = stage
            failure = report.last_failure
            mine = stage == "failed" and failure is not None and failure.instance_id == instance
            why = f": {failure.error}" if mine else ""
            echo(f"  {job.name} {instance}: {stage}{why}")
    job.joined = len(report.joined)
    if report.last_failure is not None and report.last_failure.error:
        job.boot_error = report.last_failure.error
    result = mirror_result(store)
    if inventory.ended(result):
        job.state, job.reason = result.state, result.reason
        if group is not None:
            job.sizes = (group["MinSize"], group["MaxSize"], group["DesiredCapacity"])
    return group


def _watch_good(provider: AwsContext, job: JobObservation, echo) -> None:
    """Until the first job ends: its boots, InService, its end; then what its script printed."""
    deadline, shown = time.monotonic() + GOOD_TIMEOUT, {}
    while not job.state:
        _look(provider, job, shown, echo)
        if job.state:
            break
        if time.monotonic() > deadline:
            job.timed_out = f"job {job.name} did not end within {GOOD_TIMEOUT / 60:.0f} minutes"
            break
        time.sleep(min(POLL, provider.poll_interval))
    echo(f"probe: job {job.name} {job.state or 'did not end'}" + (f": {job.reason}" if job.reason else ""))
    _read_output(provider, job)


def _read_output(provider: AwsContext, job: JobObservation) -> None:
    """The script's `probe.env` line and its last step, from the logs its agent mirrors to S3 (the last
    upload can trail the job's end by a few seconds)."""
    import json

    from petctl.providers import job_view

    deadline = time.monotonic() + 60.0
    while True:
        for line in job_view(provider, job.name).logs():
            start = line.find("{")
            if start < 0 or '"event"' not in line:
                continue
            try:
                event = json.loads(line[start:])
            except ValueError:
                continue
            if event.get("event") == "probe.env":
                job.env = event
            elif event.get("event") == "train.step":
                job.last_step = max(job.last_step, int(event.get("step", -1)))
        if (job.env and job.last_step >= STEPS - 1) or not job.state or time.monotonic() > deadline:
            return
        time.sleep(min(POLL, provider.poll_interval))


def _watch_bad(provider: AwsContext, job: JobObservation, echo) -> None:
    """Until the breaker ends the second job; then until its group, at 0, has no instance left."""
    deadline, shown = time.monotonic() + BAD_TIMEOUT, {}
    group = None
    while not job.state:
        group = _look(provider, job, shown, echo)
        if job.state:
            break
        if time.monotonic() > deadline:
            job.timed_out = (f"the boot breaker did not end job {job.name} within {BAD_TIMEOUT / 60:.0f} "
                             "minutes")
            return
        time.sleep(min(POLL, provider.poll_interval))
    echo(f"probe: job {job.name} {job.state}: {job.reason}")
    if job.sizes != (0, 0, 0):
        return
    deadline = time.monotonic() + EMPTY_TIMEOUT
    while group is not None and group.get("Instances"):
        if time.monotonic() > deadline:
            job.left_waiting = tuple(f"{i['InstanceId']} ({i.get('LifecycleState', '?')})"
                                     for i in group["Instances"])
            return
        time.sleep(min(POLL, provider.poll_interval))
        group = _look(provider, job, shown, echo)


def _remove(provider: AwsContext, job: JobObservation) -> str:
    """Delete the job's stack (the service role) and credentials (kill_job), then its S3 prefix. Returns
    the stack's status at the end ("DELETE_COMPLETE"), or why the deletion failed."""
    from petctl.providers.aws import jobrecords

    status = "DELETE_COMPLETE"
    session = provider.session()
    try:
        stack = provider.stacks(session).describe(provider.job_stack(job.name))
        jobrecords.kill(provider, job.name)
        if stack is not None:
            status = _final_status(provider, stack["StackId"])
    except JobNotFound:  # it never got a stack: stopped inside run_job, its credentials may be made
        with contextlib.suppress(Exception):
            jobrecords.delete_credentials(provider, session, job.name)
    except Exception as exc:  # noqa: BLE001 the table reports it; the clean-up goes on
        status = str(exc) if isinstance(exc, PetctlError) else f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(Exception):
        provider.store(session, job.name).delete_all()
    return status


def _final_status(provider: AwsContext, stack_id: str) -> str:
    from petctl.io.aws import ClientError

    try:
        stacks = provider.session().client("cloudformation").describe_stacks(StackName=stack_id)["Stacks"]
    except ClientError:
        return "DELETE_COMPLETE"  # gone even by its id
    return stacks[0]["StackStatus"] if stacks else "DELETE_COMPLETE"


def _leftovers(provider: AwsContext, jobs: list[str]) -> list[str]:
    """What of the probe's jobs still exists: stacks, groups, instances, S3 keys, etcd secrets. A status
    upload racing the deletion is removed once more before it counts."""
    from petctl.io.aws import ClientError
    from petctl.providers.aws import etcdsecrets

    session = provider.session()
    outputs = provider.settings["outputs"]
    found: list[str] = []
    stacks = provider.stacks(session)
    autoscaling, ec2, s3 = session.client("autoscaling"), session.client("ec2"), session.client("s3")
    for name in jobs:
        stack = stacks.describe(provider.job_stack(name))
        if stack is not None:
            found.append(f"stack {stack['StackName']} ({stack['StackStatus']})")
        groups = autoscaling.describe_auto_scaling_groups(
            AutoScalingGroupNames=[provider.job_stack(name)])["AutoScalingGroups"]
        found += [f"group {g['AutoScalingGroupName']}" for g in groups]
        filters = [{"Name": "tag:petctl:stack", "Values": [provider.base_stack]},
                   {"Name": "tag:petctl:job", "Values": [name]},
                   {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}]
        found += [f"instance {i['InstanceId']} ({i['State']['Name']})"
                  for r in ec2.describe_instances(Filters=filters)["Reservations"] for i in r["Instances"]]
        store = provider.store(session, name)
        for attempt in range(3):
            keys = s3.list_objects_v2(Bucket=outputs["BucketName"],
                                      Prefix=f"{store.prefix}/").get("KeyCount", 0)
            if not keys or attempt == 2:
                break
            time.sleep(2.0)
            with contextlib.suppress(PetctlError):
                store.delete_all()
        if keys:
            found.append(f"{keys} S3 key(s) under s3://{outputs['BucketName']}/{store.prefix}/")
        index = s3.list_objects_v2(Bucket=outputs["BucketName"],
                                   Prefix=etcdsecrets.index_key(name)).get("KeyCount", 0)
        if index:
            found.append(f"{index} etcd user index key(s) of job {name}")
        try:
            found += [f"secret {s}" for s in etcdsecrets.list_names(
                session.client("secretsmanager"), etcdsecrets.jobs_prefix(provider.base_stack, name))]
        except ClientError:
            pass
    return found


def _cost(provider: AwsContext, session, obs: Observations, since: float) -> Spend:
    """The probe's instance-hours (EC2's launch and end of each instance) at the repo's prices."""
    from petctl.jobview.cost import UsageKey
    from petctl.providers.aws import inventory

    now = time.time()
    spans = []
    try:
        for job in (obs.good, obs.bad):
            if not job.created:
                continue
            for span in inventory.billed(session.client("ec2"), session.client("autoscaling"),
                                         provider.base_stack, job.name, provider.job_stack(job.name)):
                market = span.market or "spot"
                spans.append((UsageKey(span.instance_type or "", market, span.az or ""),
                              max(span.launched_at, since), span.ended_at or now))
        from petctl.providers.aws.pricing import PRICING_REGION, AwsPrices

        # the prices' own clients fail fast ("probe" retries): a missing price is a note, not a wait
        prices = AwsPrices(session.client("ec2", profile="probe"),
                           session.client("pricing", region=PRICING_REGION, profile="probe"), session.region,
                           provider.config.home / "cache" / "aws-prices.json")
        return spend([s for s in spans if s[0].instance_type], prices)
    except Exception as exc:  # noqa: BLE001 money is reported, never a reason to skip the clean-up
        return Spend(sum(max(0.0, end - start) for _, start, end in spans) / 3600.0, None,
                     f"no price: {type(exc).__name__}")
