"""What one job's credentials can and cannot reach (issue 17), decided on the rendered templates.

Two jobs side by side, `ab` and `ab-c`: the name of one is a prefix of the other's, which is how a scope
without a trailing separator leaks. Every claim of docs/aws.md's threat model about a job's AWS rights is
one of the tables below, evaluated with tests/aws/policy_eval.py over the exact statements the templates
render (the job role's inline policy plus the base stack's WorkerPolicy, its only attachment), conditions
included. Why an evaluator and not only moto: moto checks actions and resources but none of these
conditions (test_isolation_moto.py runs the object-level cases through moto with IAM enforced, and checks
this evaluator agrees with it there).
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from tests.aws import rendered
from tests.aws.policy_eval import ALLOW, DENY, IMPLICIT, Request, allowed, evaluate, resolve
from tests.aws.rendered import BUCKET, NAMES, STACK, parse

ACCOUNT = "arn:aws:{service}:us-east-1:123456789012"
OBJ = f"arn:aws:s3:::{BUCKET}/jobs"
GROUP = "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:0f3c-uuid:autoScalingGroupName/"
LOGS = f"arn:aws:logs:us-east-1:123456789012:log-group:/petctl/{STACK}:log-stream:"


def statements_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    found = document["Statement"]
    return found if isinstance(found, list) else [found]


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return parse(rendered.base_template())


def worker(base: dict[str, Any], home, name: str, keep: bool = False) -> list[dict[str, Any]]:
    """Everything job `name`'s workers may do: its role's inline policy and the managed policies it has."""
    role = parse(rendered.named_job_template(home, name, keep=keep))["Resources"]["WorkerRole"]["Properties"]
    assert role["ManagedPolicyArns"] == [rendered.OUTPUTS["WorkerPolicyArn"]]  # nothing of AWS's (17.3)
    shared = base["Resources"]["WorkerPolicy"]["Properties"]["PolicyDocument"]
    inline = [s for p in role["Policies"] for s in statements_of(p["PolicyDocument"])]
    return resolve(inline + statements_of(shared), NAMES)


@pytest.fixture(scope="module")
def ab(base, tmp_path_factory) -> list[dict[str, Any]]:
    return worker(base, tmp_path_factory.mktemp("ab"), "ab")


# --- the evaluator itself ------------------------------------------------------------------------------
def test_the_evaluator_follows_iams_rules():
    s = [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/x/*"},
         {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b",
          "Condition": {"StringLike": {"s3:prefix": ["x/", "x/*"]}}},
         {"Effect": "Allow", "Action": "a:Up", "Resource": "*",
          "Condition": {"NumericEquals": {"a:Min": 0, "a:Max": 0}}},
         {"Effect": "Deny", "Action": "a:Up", "Resource": "*", "Condition": {"Null": {"a:Subnets": "false"}}},
         {"Effect": "Allow", "Action": "b:*", "Resource": "*",
          "Condition": {"StringNotEquals": {"b:k": "v"}}}]
    assert evaluate(s, Request("S3:getobject", "arn:aws:s3:::b/x/1")) == ALLOW  # actions ignore case
    assert evaluate(s, Request("s3:GetObject", "arn:aws:s3:::b/X/1")) == IMPLICIT  # resources do not
    assert allowed(s, "s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "x/a"})
    assert not allowed(s, "s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "x"})
    assert not allowed(s, "s3:ListBucket", "arn:aws:s3:::b")  # a missing key fails a condition
    assert allowed(s, "a:Up", "g", {"a:Min": 0, "a:Max": "0"}) and not allowed(s, "a:Up", "g", {"a:Min": 0})
    assert evaluate(s, Request("a:Up", "g", {"a:Min": 0, "a:Max": 0, "a:Subnets": ["s"]})) == DENY
    assert allowed(s, "b:Do", "r") and not allowed(s, "b:Do", "r", {"b:k": "v"})  # negated: absent is true
    with pytest.raises(ValueError, match="not implemented"):
        evaluate([{"Effect": "Allow", "Action": "*", "Condition": {"DateLessThan": {"k": "1"}}}],
                 Request("x:Y", "r", {"k": "0"}))


# --- S3: its own prefix, and not the other job's (17.5, 17.6) -----------------------------------------
OWN_READS = ["code/train.py", "code/code.tar.gz", "agent.json", "job.json", "placement.json", "result.json",
             "checkpoints/step-10/manifest.json", "status/i-1.json"]
OWN_WRITES = ["checkpoints/step-10/model.pt", "status/i-1.json", "events/i-1/1-0.jsonl", "logs/i-1/1-0.log",
              "result.json"]
CLI_ONLY = ["code/train.py", "code/code.tar.gz", "agent.json", "job.json", "placement.json", "code.tar.gz",
            "checkpoints.json", "results.json", "status"]


def test_a_job_writes_only_its_state_and_reads_its_whole_prefix(ab):
    for key in OWN_READS:
        assert allowed(ab, "s3:GetObject", f"{OBJ}/ab/{key}"), key
    for key in OWN_WRITES:
        assert allowed(ab, "s3:PutObject", f"{OBJ}/ab/{key}"), key
    for key in CLI_ONLY:  # what every replacement node runs or reads: never rewritten by the job
        assert not allowed(ab, "s3:PutObject", f"{OBJ}/ab/{key}"), key
        assert not allowed(ab, "s3:DeleteObject", f"{OBJ}/ab/{key}"), key
    assert allowed(ab, "s3:DeleteObject", f"{OBJ}/ab/checkpoints/step-10/model.pt")  # pruning old steps
    assert allowed(ab, "s3:AbortMultipartUpload", f"{OBJ}/ab/checkpoints/step-10/model.pt")
    for key in ("status/i-1.json", "events/i-1/1-0.jsonl", "logs/i-1/1-0.log", "result.json"):
        assert not allowed(ab, "s3:DeleteObject", f"{OBJ}/ab/{key}"), key


@pytest.mark.parametrize("action", ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                    "s3:AbortMultipartUpload", "s3:GetObjectVersion",
                                    "s3:DeleteObjectVersion", "s3:PutObjectAcl"])
def test_a_job_cannot_touch_another_jobs_prefix(ab, action):
    for key in OWN_READS + OWN_WRITES + ["x"]:
        assert not allowed(ab, action, f"{OBJ}/ab-c/{key}"), key  # ab is a prefix of ab-c
        assert not allowed(ab, action, f"{OBJ}-other/ab/{key}"), key
    assert not allowed(ab, action, f"arn:aws:s3:::{BUCKET}/dist/etcd/v3.5.1-abc/etcd")
    assert not allowed(ab, action, f"arn:aws:s3:::{BUCKET}/etcd-users/ab/job-ab-0000000a")  # etcd's index


def test_a_job_lists_only_below_its_own_prefix_with_its_slash(ab):
    bucket = f"arn:aws:s3:::{BUCKET}"
    for prefix in ("jobs/ab/", "jobs/ab/checkpoints/", "jobs/ab/logs/i-1/"):
        assert allowed(ab, "s3:ListBucket", bucket, {"s3:prefix": prefix}), prefix
    # "jobs/ab" (no slash) would list jobs/ab-c/... too: the slash is what tells the two jobs apart.
    for prefix in ("jobs/ab", "jobs/ab-c/", "jobs/a", "jobs/", "", "dist/"):
        assert not allowed(ab, "s3:ListBucket", bucket, {"s3:prefix": prefix}), prefix
    assert not allowed(ab, "s3:ListBucket", bucket)  # no prefix: the whole bucket
    assert not allowed(ab, "s3:ListBucketVersions", bucket, {"s3:prefix": "jobs/ab/"})


# --- CloudWatch Logs: its own streams (17.9) ----------------------------------------------------------
def test_a_job_logs_only_to_streams_under_its_name(ab):
    for action in ("logs:CreateLogStream", "logs:PutLogEvents"):
        assert allowed(ab, action, f"{LOGS}ab/i-0123456789abcdef0"), action
        for stream in ("ab-c/i-0123456789abcdef0", "i-0123456789abcdef0", "ab", "abc/i-1"):
            assert not allowed(ab, action, f"{LOGS}{stream}"), (action, stream)
        other_group = "arn:aws:logs:us-east-1:123456789012:log-group:/petctl/other:log-stream:ab/i-1"
        assert not allowed(ab, action, other_group)
    for action in ("logs:GetLogEvents", "logs:DescribeLogStreams", "logs:DeleteLogStream",
                   "logs:FilterLogEvents"):
        assert not allowed(ab, action, f"{LOGS}ab-c/i-1") and not allowed(
            ab, action, f"arn:aws:logs:us-east-1:123456789012:log-group:/petctl/{STACK}")


# --- Auto Scaling: shrink its own group to 0, nothing else (17.4) -------------------------------------
def release_contexts() -> list[tuple[str, dict[str, Any]]]:
    """The IAM action and condition keys of each call release_capacity (petctl/agent/autoscaling.py) makes,
    recorded live."""
    from petctl.agent.autoscaling import release_capacity
    from petctl.io.eventlog import EventLog

    calls: list[tuple[str, dict[str, Any]]] = []

    class Recorder:
        def __getattr__(self, name):
            return lambda **kw: calls.append(("autoscaling:" + name.title().replace("_", ""), kw))

    log = EventLog("agent", stream=io.StringIO())
    assert release_capacity(f"{STACK}-job-ab", "petctl-drain", "us-east-1", log, Recorder())
    keys = {"MinSize": "autoscaling:MinSize", "MaxSize": "autoscaling:MaxSize"}
    return [(action, {keys[k]: v for k, v in kw.items() if k in keys}) for action, kw in calls]


def test_the_release_calls_are_allowed_on_its_own_group_only(ab):
    calls = release_contexts()
    assert [a for a, _ in calls] == ["autoscaling:DeleteLifecycleHook", "autoscaling:UpdateAutoScalingGroup"]
    for action, context in calls:
        assert allowed(ab, action, GROUP + f"{STACK}-job-ab", context), action
        for other in (f"{STACK}-job-ab-c", f"{STACK}-job-a", f"{STACK}-etcd", "someone-elses-group"):
            assert not allowed(ab, action, GROUP + other, context), (action, other)


def detach_contexts() -> list[tuple[str, dict[str, Any]]]:
    """The IAM action and condition keys of the call a spot notice's detach (AwsPlace.detach_for_replacement,
    petctl/agent/autoscaling.py) makes, recorded live. DetachInstances has no condition key for its
    arguments: the context is empty."""
    from petctl.agent.autoscaling import AwsPlace
    from petctl.core.spec import AgentConfig, JobSpec
    from petctl.io.eventlog import EventLog

    calls: list[tuple[str, dict[str, Any]]] = []

    class Recorder:
        def __getattr__(self, name):
            return lambda **kw: calls.append(("autoscaling:" + name.title().replace("_", ""), kw)) or {}

    spec = JobSpec(name="ab", min_size=1, max_size=2, size=2, entrypoint="train.py")
    config = AgentConfig(job=spec, node_id="i-0123456789abcdef0", asg_name=f"{STACK}-job-ab",
                         region="us-east-1")
    place = AwsPlace(config, EventLog("agent", stream=io.StringIO()), autoscaling=Recorder())
    assert place.detach_for_replacement()
    return [(action, {}) for action, _ in calls]


def test_a_spot_notice_detaches_only_from_its_own_group_and_ends_with_no_permission(ab, base, tmp_path):
    """The detach is allowed on the job's own group only; ending the detached instance is an OS shutdown
    (the launch template's InstanceInitiatedShutdownBehavior), so no ec2:TerminateInstances on any
    instance, its own included. --keep keeps the detach: a kept job's spot instances get notices too."""
    calls = detach_contexts()
    assert [a for a, _ in calls] == ["autoscaling:DetachInstances"]
    kept = worker(base, tmp_path, "ab", keep=True)
    for action, context in calls:
        assert allowed(ab, action, GROUP + f"{STACK}-job-ab", context)
        assert allowed(kept, action, GROUP + f"{STACK}-job-ab", context)
        for other in (f"{STACK}-job-ab-c", f"{STACK}-job-a", f"{STACK}-etcd", "someone-elses-group"):
            assert not allowed(ab, action, GROUP + other, context), other
    for instance in ("i-0123456789abcdef0", "*"):
        for action in ("ec2:TerminateInstances", "ec2:StopInstances", "autoscaling:AttachInstances"):
            assert not allowed(ab, action, ACCOUNT.format(service="ec2") + f":instance/{instance}"), action


@pytest.mark.parametrize("context", [
    {"autoscaling:MinSize": 0},  # no MaxSize: the desired capacity could go up to the old maximum
    {"autoscaling:MaxSize": 0},
    {"autoscaling:MinSize": 0, "autoscaling:MaxSize": 5000},  # to the account's quota
    {"autoscaling:MinSize": 3, "autoscaling:MaxSize": 3},
    {},  # DesiredCapacity alone: IAM has no key for it, so this must not pass
    {"autoscaling:MinSize": 0, "autoscaling:MaxSize": 0, "autoscaling:VPCZoneIdentifiers": ["subnet-1"]},
    {"autoscaling:MinSize": 0, "autoscaling:MaxSize": 0,
     "autoscaling:LaunchTemplateVersionSpecified": "true"},
    {"autoscaling:MinSize": 0, "autoscaling:MaxSize": 0, "autoscaling:InstanceTypes": ["p5.48xlarge"]},
    {"autoscaling:MinSize": 0, "autoscaling:MaxSize": 0, "autoscaling:LaunchConfigurationName": "lc"},
])
def test_job_code_cannot_grow_or_reshape_its_group(ab, context):
    assert not allowed(ab, "autoscaling:UpdateAutoScalingGroup", GROUP + f"{STACK}-job-ab", context)


def test_no_other_scaling_or_instance_control(ab):
    own = GROUP + f"{STACK}-job-ab"
    for action in ("autoscaling:SetDesiredCapacity", "autoscaling:CreateAutoScalingGroup",
                   "autoscaling:PutScheduledUpdateGroupAction",
                   "autoscaling:TerminateInstanceInAutoScalingGroup",
                   "autoscaling:DeleteAutoScalingGroup", "autoscaling:PutLifecycleHook"):
        assert not allowed(ab, action, own), action
    for action in ("ec2:RunInstances", "ec2:TerminateInstances", "ec2:ModifyInstanceAttribute"):
        assert not allowed(ab, action, ACCOUNT.format(service="ec2") + ":instance/i-1"), action
    assert allowed(ab, "autoscaling:SetInstanceHealth", own)
    assert not allowed(ab, "autoscaling:CompleteLifecycleAction", GROUP + f"{STACK}-job-ab-c")


def test_keep_keeps_the_termination_hook_but_not_a_boot_loop(base, tmp_path):
    """--keep: the finished job's agent does not release it (no hook deletion), but the boot breaker
    (worker_image/boot_record.sh.j2) may still stop a group whose boots never join, and only to 0."""
    kept = worker(base, tmp_path, "ab", keep=True)
    group = GROUP + f"{STACK}-job-ab"
    assert not allowed(kept, "autoscaling:DeleteLifecycleHook", group)
    assert allowed(kept, "autoscaling:UpdateAutoScalingGroup", group,
                   {"autoscaling:MinSize": 0, "autoscaling:MaxSize": 0})
    assert not allowed(kept, "autoscaling:UpdateAutoScalingGroup", group,
                       {"autoscaling:MinSize": 0, "autoscaling:MaxSize": 4})


# --- Systems Manager, IAM, CloudFormation (17.1, 17.3) ------------------------------------------------
def test_session_manager_without_reading_parameters(ab):
    ssm = ACCOUNT.format(service="ssm")
    for action in ("ssm:GetParameter", "ssm:GetParameters", "ssm:GetParametersByPath",
                   "ssm:GetParameterHistory", "ssm:DescribeParameters", "ssm:SendCommand",
                   "ssm:StartSession", "ssm:GetDocument"):
        for resource in (f"{ssm}:parameter/prod/db-password", f"{ssm}:parameter/aws/service/x", "*"):
            assert not allowed(ab, action, resource), (action, resource)
    for action in ("ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
                   "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel"):
        assert allowed(ab, action, "*"), action
    assert allowed(ab, "ssm:UpdateInstanceInformation", ACCOUNT.format(service="ec2") + ":instance/i-1")


def test_workers_hold_no_iam_or_cloudformation_rights(ab):
    other_role = f"arn:aws:iam::123456789012:role/petctl/{STACK}/ab-c/{STACK}-job-ab-c-WorkerRole-X"
    for action in ("iam:DeleteRole", "iam:PassRole", "iam:PutRolePolicy", "iam:AttachRolePolicy",
                   "iam:DeleteInstanceProfile", "iam:CreateRole", "sts:AssumeRole"):
        assert not allowed(ab, action, other_role), action
    stack = f"arn:aws:cloudformation:us-east-1:123456789012:stack/{STACK}-job-ab-c/uuid"
    for action in ("cloudformation:DeleteStack", "cloudformation:UpdateStack", "cloudformation:CreateStack"):
        assert not allowed(ab, action, stack), action
    assert not any(a.split(":")[0] in ("iam", "sts", "cloudformation")
                   for s in ab if s["Effect"] == "Allow" for a in ([s["Action"]] if isinstance(
                       s["Action"], str) else s["Action"]))


def test_the_shared_policy_reaches_only_the_image_and_session_manager(ab, base):
    shared = resolve(statements_of(base["Resources"]["WorkerPolicy"]["Properties"]["PolicyDocument"]), NAMES)
    unscoped = sorted(a for s in shared if s["Resource"] == "*" for a in (
        [s["Action"]] if isinstance(s["Action"], str) else s["Action"]))
    assert unscoped == ["ecr:GetAuthorizationToken", "ssmmessages:CreateControlChannel",
                        "ssmmessages:CreateDataChannel", "ssmmessages:OpenControlChannel",
                        "ssmmessages:OpenDataChannel"]
    assert not allowed(ab, "ecr:BatchGetImage", "arn:aws:ecr:us-east-1:123456789012:repository/other")
    assert not allowed(ab, "ecr:PutImage", NAMES["Repository.Arn"])
    assert "AmazonSSMManagedInstanceCore" not in json.dumps(base)
