"""`petctl doctor --provider aws`: what only a real account can show, checked in one command.

Each check is one `Check` (OK / FAIL / SKIP with the reason). A check whose API the endpoint lacks (an
emulator) is SKIP, never FAIL; any FAIL makes the command exit non-zero. The checks: credentials, the
base stack, the spot vCPU quotas, the worker AMI, the worker image in ECR, and the operator's
permissions, simulated with `iam:SimulatePrincipalPolicy` for the caller's own identity.
"""

from __future__ import annotations

import re
from typing import Any

from petctl.core.errors import PetctlError
from petctl.providers.base import Check

# What the CLI calls on a user's behalf after `setup` (setup itself creates IAM roles, a VPC, a bucket:
# it needs administrator-level rights once; docs/aws.md lists them).
OPERATOR_ACTIONS = (
    "sts:GetCallerIdentity", "cloudformation:CreateStack", "cloudformation:DeleteStack",
    "cloudformation:DescribeStacks", "cloudformation:DescribeStackEvents", "cloudformation:GetTemplate",
    "autoscaling:DescribeAutoScalingGroups", "autoscaling:UpdateAutoScalingGroup",
    "autoscaling:SetDesiredCapacity", "autoscaling:DescribeScalingActivities",
    # run_job suspends AZRebalance on the new group (capacity.suspend_processes), and picks the AZ from
    # where its instance types are offered (capacity.py).
    "autoscaling:SuspendProcesses", "ec2:DescribeInstanceTypeOfferings", "ec2:DescribeInstances",
    "ec2:DescribeInstanceTypes", "ec2:DescribeImages", "ec2:TerminateInstances",
    "ec2:DescribeAvailabilityZones", "ec2:DescribeSpotPriceHistory", "ecr:BatchGetImage",
    "ecr:GetDownloadUrlForLayer",
    "s3:GetObject", "s3:PutObject", "s3:ListBucket", "servicequotas:GetServiceQuota", "ssm:GetParameter",
    "pricing:GetProducts", "iam:SimulatePrincipalPolicy",
    # etcd's credentials (petctl/providers/aws/etcdsecrets.py): run_job signs each job's certificate with
    # the operator's secret and stores it in one of its own; kill_job and the clean-up delete it.
    "secretsmanager:GetSecretValue", "secretsmanager:CreateSecret", "secretsmanager:TagResource",
    "secretsmanager:ListSecrets", "secretsmanager:DeleteSecret",
    # ... and indexes each run's etcd user in the bucket for the etcd hosts (kill_job deletes the entry).
    "s3:DeleteObject",
    # `doctor --probe` (probe.py): its job role's boundary, and the probe jobs' prefixes removed with
    # every version (the bucket is versioned).
    "cloudformation:DescribeStackResource", "iam:GetRole", "s3:ListBucketVersions", "s3:DeleteObjectVersion",
)
QUOTA_PROBES = (("L-3819A6DF", "All G and VT Spot Instance Requests", "g4dn.xlarge"),
                ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", "c5.large"))
UNAVAILABLE = ("NotImplemented", "InvalidAction", "UnknownOperation", "NotImplementedError", "404", "501")


def principal_arn(caller_arn: str) -> str:
    """The IAM principal to simulate: an assumed role's role, a user as is; "" for the root user."""
    match = re.match(r"^arn:(?P<p>[^:]+):sts::(?P<acct>\d+):assumed-role/(?P<role>[^/]+)/.+$", caller_arn)
    if match:
        return f"arn:{match['p']}:iam::{match['acct']}:role/{match['role']}"
    return "" if caller_arn.endswith(":root") else caller_arn


def _unavailable(exc: BaseException) -> bool:
    """True when the endpoint lacks the API (an emulator): unknown action, not implemented, or an
    internal error page instead of an AWS response."""
    from petctl.io.aws import ResponseParserError, error_code

    if isinstance(exc, ResponseParserError):
        return True
    code = error_code(exc)
    status = str((getattr(exc, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return (isinstance(exc, NotImplementedError) or code in UNAVAILABLE or status in UNAVAILABLE
            or "not been implemented" in str(exc) or "not yet implemented" in str(exc).lower())


def _guard(name: str, call) -> Check:
    """Run one check; an AWS error becomes FAIL with AWS's reason, a missing API a SKIP."""
    from petctl.io.aws import BotoCoreError, ClientError, ResponseParserError, error_code, error_message

    try:
        return call()
    except (ClientError, NotImplementedError, ResponseParserError) as exc:
        if _unavailable(exc):
            why = error_code(exc) or type(exc).__name__
            return Check(name, "SKIP", f"this endpoint does not implement the API ({why})")
        return Check(name, "FAIL", f"{error_code(exc)}: {error_message(exc)[:200]}")
    except BotoCoreError as exc:
        return Check(name, "FAIL", str(exc)[:200])
    except PetctlError as exc:
        return Check(name, "FAIL", str(exc))


def run_checks(session, settings: dict[str, Any], stack_name: str) -> list[Check]:
    from petctl.providers.aws import capacity
    from petctl.providers.aws.stacks import StackOps

    checks: list[Check] = []
    identity: dict[str, str] = {}

    def credentials() -> Check:
        identity.update(session.client("sts").get_caller_identity())
        return Check("credentials", "OK", f"{identity['Arn']} in {session.region}")

    checks.append(_guard("credentials", credentials))
    if not identity:
        return checks

    def base_stack() -> Check:
        stack = StackOps(session.client("cloudformation")).describe(stack_name)
        if stack is None or not settings.get("ready"):
            return Check("base stack", "FAIL",
                         f"stack {stack_name} not found: run `petctl setup --provider aws`")
        status = stack["StackStatus"]
        ok = status in ("CREATE_COMPLETE", "UPDATE_COMPLETE")
        return Check("base stack", "OK" if ok else "FAIL", f"{stack_name} is {status}")

    checks.append(_guard("base stack", base_stack))

    servicequotas = session.client("service-quotas", profile="probe")  # unreadable is a warning, not a wait
    vcpus = capacity.instance_vcpus(session.client("ec2"), [probe for _, _, probe in QUOTA_PROBES])
    for code, name, probe in QUOTA_PROBES:
        quota = capacity.fetch_quota(servicequotas, code, name)
        label = f"spot vCPU quota {code} ({name})"
        if quota.value is None:
            checks.append(Check(label, "SKIP", quota.why_unknown))
        elif probe in vcpus and quota.value < vcpus[probe]:
            checks.append(Check(label, "FAIL", f"{quota.value:g} vCPUs, below one {probe} ({vcpus[probe]}): "
                                               "request an increase in Service Quotas"))
        else:
            checks.append(Check(label, "OK", f"{quota.value:g} vCPUs"))

    def ami() -> Check:
        from petctl.providers.aws.boot import AMI_PYTHON, resolve

        image_ref = settings.get("image", "")
        found = resolve(session.client("ssm"), session.client("ec2"), settings, container=bool(image_ref))
        if not found.name:
            return Check("worker AMI", "FAIL", f"{found.image_id} (from {found.source}) does not exist in "
                                               f"{session.region}")
        if image_ref:
            return Check("worker AMI", "OK", f"{found.image_id} ({found.name}); torch and CUDA: the image's")
        return Check("worker AMI", "OK", f"jobs get torch {found.torch or 'unknown'} with CUDA "
                                         f"{found.cuda or 'unknown'} ({AMI_PYTHON}) from {found.image_id} "
                                         f"({found.name})")

    checks.append(_guard("worker AMI", ami))

    def image() -> Check:
        from petctl.providers.aws.boot import check_image

        ref = settings.get("image", "")
        if not ref:
            return Check("worker image", "OK", "none: jobs run on the Deep Learning AMI's Python (run_job "
                                               "--image runs one)")
        platform = check_image(session.client("ecr"), ref, session.region)
        return Check("worker image", "OK", f"{ref}: {platform}")

    checks.append(_guard("worker image", image))
    checks.append(_guard("operator permissions", lambda: permissions(session, identity["Arn"], settings)))
    return checks


def permissions(session, caller_arn: str, settings: dict[str, Any]) -> Check:
    """Simulate the CLI's calls, and iam:PassRole of the job stacks' service role, for the caller."""
    principal = principal_arn(caller_arn)
    if not principal:
        return Check("operator permissions", "SKIP", "the root user is not subject to IAM policies")
    iam = session.client("iam", profile="probe")  # a missing API is an answer here, not worth ten retries
    results = iam.simulate_principal_policy(PolicySourceArn=principal,
                                            ActionNames=list(OPERATOR_ACTIONS))["EvaluationResults"]
    role = settings.get("outputs", {}).get("JobStackRoleArn", "")
    if role:
        results += iam.simulate_principal_policy(PolicySourceArn=principal, ActionNames=["iam:PassRole"],
                                                 ResourceArns=[role])["EvaluationResults"]
    denied = sorted(r["EvalActionName"] for r in results if r.get("EvalDecision") != "allowed")
    if denied:
        return Check("operator permissions", "FAIL", f"{principal} may not: {', '.join(denied)}")
    return Check("operator permissions", "OK", f"{principal} may make every call petctl makes "
                                               f"({len(results)} simulated)")
