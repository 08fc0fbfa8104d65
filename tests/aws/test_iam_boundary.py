"""The job stacks' IAM follows AWS's delegation pattern (issue 24.2), judged with IAM's logic.

Whoever may pass the base stack's CloudFormation service role (JobStackRole) makes job roles through it.
Two faults made that role unsafe: it allowed `iam:CreateRole` only with the stack tag in the request
(`aws:RequestTag`) and `iam:TagRole` only on a role already tagged, while CloudFormation's `AWS::IAM::Role`
has created roles and tagged them afterwards, or retried without tags (coverage roadmap issues 328 and
1859): the first run_job would roll back. And it could put any inline policy on a job role, which then
runs on an instance: a way to administrator rights.

AWS's pattern for delegated role creation (IAM User Guide, "Permissions boundaries for IAM entities"): a
role may be created, and its policies changed, only with the delegator's permissions boundary on it
(condition key `iam:PermissionsBoundary`); removing the boundary, or changing the boundary policy, is
denied. petctl's boundary (the base stack's JobBoundary) allows only what a job's instances need (the
union of what job roles are granted), so even a role with `"Action": "*"` stays inside it.

Every request below is evaluated with tests/aws/policy_eval.py over the statements the templates render,
with the context keys IAM would send. Creating a role is modelled both ways CloudFormation has done it:
tags in the CreateRole request (IAM then also authorizes iam:TagRole for those tags, on a role that has
no tags yet), and CreateRole without tags followed by TagRole.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.aws import rendered
from tests.aws.policy_eval import ALLOW, DENY, Request, evaluate, evaluate_bounded, resolve
from tests.aws.rendered import NAMES, OUTPUTS, STACK, parse

ACCOUNT = "arn:aws:iam::123456789012"
BOUNDARY = OUTPUTS["JobBoundaryArn"]
OTHER_BOUNDARY = f"{ACCOUNT}:policy/SomeWiderBoundary"
ADMIN = "arn:aws:iam::aws:policy/AdministratorAccess"
PATH = f"/petctl/{STACK}/ab/"
ROLE = f"{ACCOUNT}:role{PATH}{STACK}-job-ab-WorkerRole-" + "X" * 12
TAGS = {"aws:RequestTag/petctl:stack": STACK, "aws:RequestTag/petctl:job": "ab",
        "aws:TagKeys": ["petctl:stack", "petctl:job"]}
TAGGED = {"iam:ResourceTag/petctl:stack": STACK, "iam:ResourceTag/petctl:job": "ab"}
BOUNDARY_EDITS = ("iam:CreatePolicyVersion", "iam:DeletePolicy", "iam:DeletePolicyVersion",
                  "iam:SetDefaultPolicyVersion")


def statements_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    found = document["Statement"]
    return found if isinstance(found, list) else [found]


def inline(role: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for p in role["Properties"].get("Policies", []) for s in statements_of(p["PolicyDocument"])]


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return parse(rendered.base_template())


@pytest.fixture(scope="module")
def service(base) -> list[dict[str, Any]]:
    """JobStackRole's policy: what CloudFormation may do for a job stack."""
    return resolve(inline(base["Resources"]["JobStackRole"]), NAMES)


@pytest.fixture(scope="module")
def boundary(base) -> list[dict[str, Any]]:
    policy = base["Resources"]["JobBoundary"]["Properties"]["PolicyDocument"]
    return resolve(statements_of(policy), NAMES)


def worker(base: dict[str, Any], home, name: str = "ab", keep: bool = False,
           variant: str = "") -> list[dict[str, Any]]:
    """A job role's identity policies: its inline policy and the base stack's WorkerPolicy."""
    text = (rendered.job_template(home, variant) if variant
            else rendered.named_job_template(home, name, keep=keep))
    role = parse(text)["Resources"]["WorkerRole"]
    shared = statements_of(base["Resources"]["WorkerPolicy"]["Properties"]["PolicyDocument"])
    return resolve(inline(role) + shared, NAMES)


def verdict(statements: list[dict[str, Any]], action: str, resource: str, **context: Any) -> str:
    return evaluate(statements, Request(action, resource, context))


def create_with_tags(service: list[dict[str, Any]], role: str, **context: Any) -> bool:
    """CreateRole with Tags: IAM authorizes iam:CreateRole and, for the tags, iam:TagRole on a role that
    has no tags yet (no iam:ResourceTag keys)."""
    return (verdict(service, "iam:CreateRole", role, **TAGS, **context) == ALLOW
            and verdict(service, "iam:TagRole", role, **TAGS, **context) == ALLOW)


def create_then_tag(service: list[dict[str, Any]], role: str, **context: Any) -> bool:
    """CreateRole without tags, then TagRole on the new role (which has its boundary, and no tags)."""
    created = verdict(service, "iam:CreateRole", role, **context) == ALLOW
    return created and verdict(service, "iam:TagRole", role, **TAGS, **{
        k: v for k, v in context.items() if k == "iam:PermissionsBoundary"}) == ALLOW


# --- the service role -----------------------------------------------------------------------------------
@pytest.mark.parametrize("create", [create_with_tags, create_then_tag], ids=["tags-on-create", "tag-after"])
def test_the_service_role_creates_a_job_role_only_with_the_boundary(service, create):
    assert create(service, ROLE, **{"iam:PermissionsBoundary": BOUNDARY})  # no tag needed, either order
    assert not create(service, ROLE)  # no boundary
    for other in (OTHER_BOUNDARY, ADMIN, OUTPUTS["WorkerPolicyArn"]):
        assert not create(service, ROLE, **{"iam:PermissionsBoundary": other}), other


def test_a_retry_without_tags_still_creates_the_role(service):
    # CloudFormation's fallback when tagging is refused (roadmap issue 1859): nothing rests on tags.
    assert verdict(service, "iam:CreateRole", ROLE, **{"iam:PermissionsBoundary": BOUNDARY}) == ALLOW


def test_the_service_role_changes_policies_only_on_roles_with_the_boundary(service):
    ours = {"iam:PermissionsBoundary": BOUNDARY}
    attach = {"iam:PolicyARN": OUTPUTS["WorkerPolicyArn"]}
    for action, extra in (("iam:PutRolePolicy", {}), ("iam:DeleteRolePolicy", {}),
                          ("iam:AttachRolePolicy", attach), ("iam:DetachRolePolicy", attach)):
        assert verdict(service, action, ROLE, **ours, **extra) == ALLOW, action
        for context in ({}, {"iam:PermissionsBoundary": OTHER_BOUNDARY}):
            # the stack's tags on the role change nothing: a role without the boundary is not ours
            assert verdict(service, action, ROLE, **TAGGED, **context, **extra) != ALLOW, (action, context)
    # only WorkerPolicy may be attached, even on a bounded role; never the boundary as a permission
    for policy in (ADMIN, BOUNDARY, "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"):
        assert verdict(service, "iam:AttachRolePolicy", ROLE, **ours, **{"iam:PolicyARN": policy}) != ALLOW


def test_the_service_role_cannot_remove_or_swap_the_boundary_explicitly(service):
    for context in ({"iam:PermissionsBoundary": BOUNDARY}, {**TAGGED, "iam:PermissionsBoundary": BOUNDARY}):
        assert verdict(service, "iam:DeleteRolePermissionsBoundary", ROLE, **context) == DENY
    for other in (OTHER_BOUNDARY, ADMIN):
        assert verdict(service, "iam:PutRolePermissionsBoundary", ROLE,
                       **{"iam:PermissionsBoundary": other}) == DENY
    # Setting the boundary it already has (CloudFormation's update handler) stays possible.
    assert verdict(service, "iam:PutRolePermissionsBoundary", ROLE,
                   **{"iam:PermissionsBoundary": BOUNDARY}) == ALLOW
    for action in BOUNDARY_EDITS:
        assert verdict(service, action, BOUNDARY) == DENY, action
        assert verdict(service, action, OUTPUTS["WorkerPolicyArn"]) == DENY, action


def test_a_role_outside_the_stacks_iam_path_is_refused(service):
    ours = {"iam:PermissionsBoundary": BOUNDARY}
    for outside in (f"{ACCOUNT}:role/r", f"{ACCOUNT}:role/petctl/r", f"{ACCOUNT}:role/petctl/{STACK}-x/ab/r",
                    f"{ACCOUNT}:role/{STACK}-job-ab-WorkerRole-X", f"{ACCOUNT}:role/other/petctl/{STACK}/r"):
        assert not create_with_tags(service, outside, **ours), outside
        assert not create_then_tag(service, outside, **ours), outside
        for action in ("iam:PutRolePolicy", "iam:DeleteRole", "iam:UpdateAssumeRolePolicy"):
            assert verdict(service, action, outside, **ours) != ALLOW, (action, outside)
        to_ec2 = {"iam:PassedToService": "ec2.amazonaws.com"}
        assert verdict(service, "iam:PassRole", outside, **to_ec2) != ALLOW


def test_the_service_role_passes_job_roles_to_ec2_only(service):
    assert verdict(service, "iam:PassRole", ROLE, **{"iam:PassedToService": "ec2.amazonaws.com"}) == ALLOW
    assert verdict(service, "iam:PassRole", ROLE, **{"iam:PassedToService": "lambda.amazonaws.com"}) != ALLOW


# --- the service role's EC2 reach (issue 44.5) ----------------------------------------------------------
EC2 = "arn:aws:ec2:us-east-1:123456789012"
VPC = f"{EC2}:vpc/{OUTPUTS['VpcId']}"
OTHER_VPC = f"{EC2}:vpc/vpc-0fedcba9876543210"
GROUP_ACTIONS = ("ec2:AuthorizeSecurityGroupIngress", "ec2:AuthorizeSecurityGroupEgress",
                 "ec2:RevokeSecurityGroupIngress", "ec2:RevokeSecurityGroupEgress", "ec2:DeleteSecurityGroup",
                 "ec2:CreateSecurityGroup", "ec2:CreateTags", "ec2:DeleteTags")


def test_the_service_role_changes_security_groups_only_in_the_stacks_vpc(service):
    group = f"{EC2}:security-group/sg-0aaaaaaaaaaaaaaaa"
    for action in GROUP_ACTIONS:
        assert verdict(service, action, group, **{"ec2:Vpc": VPC}) == ALLOW, action
        assert verdict(service, action, group, **{"ec2:Vpc": OTHER_VPC}) != ALLOW, action
        assert verdict(service, action, group) != ALLOW, action  # a group whose VPC is not known
    assert verdict(service, "ec2:CreateSecurityGroup", VPC) == ALLOW
    assert verdict(service, "ec2:CreateSecurityGroup", OTHER_VPC) != ALLOW


def test_the_service_role_launches_only_from_the_stacks_launch_templates(service):
    ours = f"{EC2}:launch-template/lt-0aaaaaaaaaaaaaaaa"
    from_ours = {"ec2:LaunchTemplate": ours}
    tagged = {"aws:ResourceTag/petctl:stack": STACK, **from_ours}
    assert verdict(service, "ec2:RunInstances", ours, **tagged) == ALLOW
    for resource in ("instance/i-0a", "volume/vol-0a", "network-interface/eni-0a", "subnet/subnet-0a",
                     "security-group/sg-0a"):
        assert verdict(service, "ec2:RunInstances", f"{EC2}:{resource}", **from_ours) == ALLOW, resource
        assert verdict(service, "ec2:RunInstances", f"{EC2}:{resource}") != ALLOW, resource  # no template
    # another stack's template, or an untagged one, launches nothing
    for context in ({"aws:ResourceTag/petctl:stack": f"{STACK}-x", **from_ours}, from_ours):
        assert verdict(service, "ec2:RunInstances", ours, **context) != ALLOW, context


def test_the_service_role_tags_ec2_resources_only_as_they_are_created(service):
    instance = f"{EC2}:instance/i-0aaaaaaaaaaaaaaaa"
    for create in ("RunInstances", "CreateLaunchTemplate", "CreateSecurityGroup"):
        assert verdict(service, "ec2:CreateTags", instance, **{"ec2:CreateAction": create}) == ALLOW
    assert verdict(service, "ec2:CreateTags", instance) != ALLOW  # an existing instance of anyone's
    assert verdict(service, "ec2:CreateTags", f"{EC2}:volume/vol-0a") != ALLOW


def test_the_service_role_cannot_change_a_job_roles_trust(service):
    # Only the AWS::IAM::Role update handler calls it, and petctl never updates a job stack: its trust is
    # EC2's, fixed at creation. A new trust would let another principal take the job's credentials.
    for context in ({}, {"iam:PermissionsBoundary": BOUNDARY}):
        assert verdict(service, "iam:UpdateAssumeRolePolicy", ROLE, **context) != ALLOW


# --- the boundary ---------------------------------------------------------------------------------------
def test_every_job_role_is_created_with_the_boundary(base, tmp_path):
    for variant in rendered.JOB_VARIANTS:
        job = parse(rendered.job_template(tmp_path, variant))
        roles = [r for r in job["Resources"].values() if r["Type"] == "AWS::IAM::Role"]
        assert roles and all(r["Properties"]["PermissionsBoundary"] == BOUNDARY for r in roles), variant
    assert base["Outputs"]["JobBoundaryArn"]["Value"] == {"Ref": "JobBoundary"}


def _grants(statements: list[dict[str, Any]]) -> list[Request]:
    """One concrete request per (action, resource) an Allow statement grants, with a context that meets
    its conditions (a wildcard stands for any name)."""
    requests = []
    for s in statements:
        if s["Effect"] != "Allow":
            continue
        context: dict[str, Any] = {}
        for block in s.get("Condition", {}).values():
            for key, value in block.items():
                first = value[0] if isinstance(value, list) else value
                context[key] = str(first).replace("*", "x")
        actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
        resources = s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]
        requests += [Request(a, r.replace("*", "x"), context) for a in actions for r in resources]
    return requests


@pytest.mark.parametrize("variant", sorted(rendered.JOB_VARIANTS) + ["keep"])
def test_everything_a_job_role_is_granted_lies_inside_the_boundary(base, boundary, tmp_path, variant):
    grants = (worker(base, tmp_path, keep=True) if variant == "keep"
              else worker(base, tmp_path, variant=variant))
    requests = _grants(grants)
    assert len(requests) > 15
    outside = [f"{r.action} {r.resource}" for r in requests if evaluate_bounded(grants, boundary, r) != ALLOW]
    assert outside == []  # a grant the boundary cuts off is a job that fails on AWS only


def test_a_bounded_role_with_a_wide_inline_policy_stays_inside_the_boundary(boundary):
    everything = [{"Effect": "Allow", "Action": "*", "Resource": "*"}]
    bucket = f"arn:aws:s3:::{rendered.BUCKET}"
    secret = f"arn:aws:secretsmanager:us-east-1:123456789012:secret:{STACK}/etcd"
    group = "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:u:autoScalingGroupName/"
    refused = [
        ("iam:CreateRole", f"{ACCOUNT}:role/x", {}), ("iam:AttachRolePolicy", ROLE, {"iam:PolicyARN": ADMIN}),
        ("iam:DeleteRolePermissionsBoundary", ROLE, {}), ("iam:CreatePolicyVersion", BOUNDARY, {}),
        ("iam:PassRole", ROLE, {}), ("sts:AssumeRole", ROLE, {}),
        ("cloudformation:DeleteStack", "arn:aws:cloudformation:us-east-1:123456789012:stack/x/y", {}),
        ("ec2:RunInstances", "arn:aws:ec2:us-east-1:123456789012:instance/x", {}),
        ("s3:GetObject", f"{bucket}/dist/etcd/v3.5.33-x/etcd", {}),
        ("s3:PutObject", f"{bucket}/jobs/ab/code/a", {}), ("s3:PutObject", f"{bucket}/etcd-users/ab/u", {}),
        ("s3:DeleteObject", f"{bucket}/jobs/ab/status/i", {}),
        ("s3:ListBucket", bucket, {"s3:prefix": ""}), ("s3:ListBucket", bucket, {"s3:prefix": "dist/"}),
        ("s3:GetObject", "arn:aws:s3:::another-bucket/jobs/ab/x", {}),
        ("secretsmanager:GetSecretValue", f"{secret}/operator-AbCdEf", {}),
        ("secretsmanager:GetSecretValue", f"{secret}/host-AbCdEf", {}),
        ("secretsmanager:ListSecrets", "*", {}),
        ("ssm:GetParameter", "arn:aws:ssm:us-east-1:123456789012:parameter/prod/db", {}),
        ("autoscaling:UpdateAutoScalingGroup", group + f"{STACK}-job-ab", {"autoscaling:MaxSize": 50}),
        ("autoscaling:SetDesiredCapacity", group + f"{STACK}-job-ab", {}),
        ("autoscaling:CompleteLifecycleAction", group + f"{STACK}-etcd", {}),
    ]
    for action, resource, context in refused:
        assert evaluate_bounded(everything, boundary, Request(action, resource, context)) != ALLOW, action
    # ... while its own job's work still passes
    own = Request("s3:GetObject", f"{bucket}/jobs/ab/code/a")
    assert evaluate_bounded(everything, boundary, own) == ALLOW


def test_nothing_can_remove_or_change_the_boundary(base, service, boundary, tmp_path):
    """The service role (explicitly denied), every job role (bounded), and every etcd role."""
    cluster = parse(rendered.base_template(etcd_nodes=3))
    etcd_roles = {name: resolve(inline(r), NAMES) for name, r in cluster["Resources"].items()
                  if r["Type"] == "AWS::IAM::Role" and name.startswith("EtcdRole")}
    assert len(etcd_roles) == 3
    jobs = {v: worker(base, tmp_path, variant=v) for v in rendered.JOB_VARIANTS}
    attempts = [Request("iam:DeleteRolePermissionsBoundary", ROLE, {"iam:PermissionsBoundary": BOUNDARY}),
                *(Request("iam:PutRolePermissionsBoundary", ROLE, {"iam:PermissionsBoundary": b})
                  for b in (OTHER_BOUNDARY, ADMIN)),
                *(Request(a, BOUNDARY) for a in BOUNDARY_EDITS)]
    for request in attempts:
        assert evaluate(service, request) != ALLOW, request
        for name, statements in etcd_roles.items():
            assert evaluate(statements, request) != ALLOW, (name, request)
        for variant, statements in jobs.items():
            assert evaluate_bounded(statements, boundary, request) != ALLOW, (variant, request)


def test_the_policies_fit_iams_size_quotas():
    """IAM refuses a managed policy over 6,144 characters and a role's inline policies over 10,240 in all
    (whitespace not counted): checked on the longest stack name petctl accepts."""
    import json

    template = parse(rendered.base_template(stack=rendered.LONG_STACK))["Resources"]
    names = {**NAMES, "LogGroup": f"/petctl/{rendered.LONG_STACK}"}

    def size(document: dict[str, Any]) -> int:
        return len(json.dumps(resolve(document, names), separators=(",", ":")))

    assert size(template["JobBoundary"]["Properties"]["PolicyDocument"]) < 6_144
    assert size(template["WorkerPolicy"]["Properties"]["PolicyDocument"]) < 6_144
    inline = [p["PolicyDocument"] for p in template["JobStackRole"]["Properties"]["Policies"]]
    assert sum(size(d) for d in inline) < 10_240
