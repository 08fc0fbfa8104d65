"""Who may do what to a job stack (issue 11, item 3), checked against AWS's published contracts.

CloudFormation runs a resource's create/update/delete handlers with the stack's service role, and each
handler's required IAM actions are published in the resource type's registry schema (`handlers.*.
permissions`). moto enforces no IAM, so the contract is checked on the rendered templates:

- the base stack's JobStackRole (the service role the CLI passes as RoleARN) allows every action of
  every handler of every resource type in the job stack (wildcards such as `autoscaling:Describe*`
  matched with fnmatch, as IAM matches them);
- the workers' own role allows exactly the calls the agent's release path makes (petctl/agent/autoscaling.py,
  read with `ast`), and nothing that deletes a stack or passes a role.

The schemas: the installed cfn-lint's, when they still carry `handlers` (releases after 1.3 strip them);
otherwise `fixtures/cfn_handler_permissions.json`, extracted from cfn-lint 1.3.0's copy of the registry.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests.aws import rendered
from tests.aws.rendered import STACK, parse

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "cfn_handler_permissions.json"
HANDLERS = ("create", "update", "delete")
# Listed by a handler, but not an IAM service prefix (cfn-lint W3037 rejects it): no policy can grant it.
NOT_IAM_SERVICES = {"managed-fleets"}
# Listed by a handler, and denied on purpose (issue 24.2): the AWS::IAM::Role update handler removes a
# role's permissions boundary only when the template drops PermissionsBoundary, which no job template
# does (tests/aws/test_iam_boundary.py::test_every_job_role_is_created_with_the_boundary).
DENIED_ON_PURPOSE = {("AWS::IAM::Role", "update", "iam:DeleteRolePermissionsBoundary"),
                     # and (issue 44.5) a new trust policy: petctl never updates a job stack, and its role
                     # trusts EC2 from creation on (test_iam_boundary.py).
                     ("AWS::IAM::Role", "update", "iam:UpdateAssumeRolePolicy")}


@cache
def handler_permissions(resource_type: str) -> dict[str, list[str]]:
    """{handler: [actions]} from the installed cfn-lint's registry schema, else from the fixture."""
    try:
        import cfnlint
        from cfnlint.data.schemas.providers import us_east_1

        schemas = Path(cfnlint.__file__).parent / "data" / "schemas" / "resources"
        path = schemas / f"{us_east_1.types[resource_type]}.json"
        handlers = json.loads(path.read_text()).get("handlers", {})
    except (ImportError, KeyError, AttributeError, OSError):
        handlers = {}
    if handlers:
        return {h: handlers[h]["permissions"] for h in HANDLERS if h in handlers}
    return json.loads(FIXTURE.read_text())["types"][resource_type]


def statements(policy: dict[str, Any]) -> list[dict[str, Any]]:
    found = policy.get("Statement", [])
    return found if isinstance(found, list) else [found]


def _listed(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def allows(policy_statements: list[dict[str, Any]], action: str) -> bool:
    """IAM's action matching: case-insensitive, `*` and `?` wildcards; an unconditional Deny wins. A Deny
    with a Condition refuses only some requests of the action (its conditions are evaluated with IAM's
    logic in tests/aws/test_iam_boundary.py), so it does not take the action away here."""
    def matches(statement: dict[str, Any]) -> bool:
        return any(fnmatch.fnmatchcase(action.lower(), pattern.lower())
                   for pattern in _listed(statement.get("Action", [])))

    if any(s["Effect"] == "Deny" and "Condition" not in s and matches(s) for s in policy_statements):
        return False
    return any(s["Effect"] == "Allow" and matches(s) for s in policy_statements)


def role_statements(role: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for p in role["Properties"].get("Policies", []) for s in statements(p["PolicyDocument"])]


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return parse(rendered.base_template())


@pytest.fixture(scope="module", params=sorted(rendered.JOB_VARIANTS))
def job(request, tmp_path_factory) -> dict[str, Any]:
    return parse(rendered.job_template(tmp_path_factory.mktemp("job"), request.param))


def test_the_allows_helper_handles_wildcards_and_denies():
    policy = [{"Effect": "Allow", "Action": ["autoscaling:Describe*", "ec2:Get*"]},
              {"Effect": "Deny", "Action": "ec2:GetConsoleOutput"}]
    assert allows(policy, "autoscaling:DescribeAutoScalingGroups")
    assert allows(policy, "AutoScaling:describescalingactivities")  # IAM ignores case in actions
    assert not allows(policy, "autoscaling:DeleteAutoScalingGroup")
    assert not allows(policy, "ec2:GetConsoleOutput")


def test_service_role_can_create_update_and_delete_every_job_resource(base, job):
    service_role = base["Resources"]["JobStackRole"]
    policy = role_statements(service_role)
    kinds = {r["Type"] for r in job["Resources"].values()}
    assert kinds == {"AWS::IAM::Role", "AWS::IAM::InstanceProfile", "AWS::EC2::LaunchTemplate",
                     "AWS::AutoScaling::AutoScalingGroup", "AWS::EC2::SecurityGroup",
                     "AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress",
                     }  # a new type needs its handlers checked here
    missing = [f"{kind} {handler}: {action}" for kind in sorted(kinds)
               for handler, actions in handler_permissions(kind).items() for action in actions
               if action.split(":")[0] not in NOT_IAM_SERVICES and not allows(policy, action)
               and (kind, handler, action) not in DENIED_ON_PURPOSE]
    assert missing == []
    for kind, handler, action in DENIED_ON_PURPOSE:  # still what the schema lists, and still denied
        assert action in handler_permissions(kind)[handler] and not allows(policy, action)


def test_the_delete_handlers_that_failed_from_the_worker_role_are_covered(base):
    # the DELETE_FAILED of issue 11: these were missing when the worker's credentials deleted the stack
    policy = role_statements(base["Resources"]["JobStackRole"])
    for action in ("autoscaling:DescribeAutoScalingGroups", "ec2:DescribeLaunchTemplates", "ec2:DeleteTags",
                   "iam:ListRolePolicies", "iam:ListAttachedRolePolicies", "iam:DeleteRole",
                   "iam:DeleteRolePolicy"):
        assert allows(policy, action), action


def test_service_role_is_for_cloudformation_and_scoped_to_this_installations_jobs(base):
    role = base["Resources"]["JobStackRole"]["Properties"]
    (trust,) = role["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "cloudformation.amazonaws.com"}
    # AWS's documented trust for a stack service role (issue 44.2): no document says CloudFormation sets
    # aws:SourceAccount when it assumes one, and a condition on an absent key fails every job stack.
    # iam:PassRole already limits who hands the role over.
    assert "Condition" not in trust
    for s in role_statements(base["Resources"]["JobStackRole"]):
        actions = _listed(s["Action"])
        if s["Effect"] == "Allow" and any(a.startswith("iam:") for a in actions):  # only under the IAM path
            resources = json.dumps(s["Resource"])
            assert (f"role/petctl/{STACK}/*" in resources or f"instance-profile/petctl/{STACK}/*" in resources
                    or "AWSServiceRoleForAutoScaling" in resources), s["Sid"]
            assert "-job-" not in resources, s["Sid"]  # never a name prefix (issue 17.1)
            # nothing rests on tags (issue 24.2): CloudFormation has tagged roles after creating them
            assert "Tag/" not in json.dumps(s.get("Condition", {})), s["Sid"]
        if "iam:PassRole" in actions:
            assert s["Condition"]["StringEquals"]["iam:PassedToService"] == "ec2.amazonaws.com"
        if any(a.startswith("autoscaling:") and not a.endswith("Describe*") for a in actions):
            assert json.dumps(s["Resource"]).endswith(f'autoScalingGroupName/{STACK}-job-*"}}'), s["Sid"]
    policy = role_statements(base["Resources"]["JobStackRole"])
    assert allows(policy, "ec2:GetLaunchTemplateData") and not allows(policy, "ec2:GetPasswordData")
    assert not allows(policy, "cloudformation:DeleteStack")  # a service role needs no CloudFormation API
    outputs = base["Outputs"]
    assert outputs["JobStackRoleArn"]["Value"] == {"Fn::GetAtt": ["JobStackRole", "Arn"]}


def test_service_role_manages_job_roles_by_path_and_boundary_never_by_name_or_tag(base, tmp_path):
    """Issue 17.1 and 24.2, evaluated with IAM's logic (tests/aws/policy_eval.py), conditions included:
    the service role reaches a job's role through the job's IAM path and the installation's permissions
    boundary, whatever CloudFormation names the role (cut at 64 characters), with or without its tags, and
    nothing that merely shares the name prefix (tests/aws/test_iam_boundary.py: the delegation pattern)."""
    from tests.aws.policy_eval import allowed, resolve
    from tests.aws.rendered import NAMES, named_job_template

    policy = resolve(role_statements(base["Resources"]["JobStackRole"]), NAMES)
    role = "arn:aws:iam::123456789012:role"
    profile = "arn:aws:iam::123456789012:instance-profile"
    bounded = {"iam:PermissionsBoundary": NAMES["JobBoundary"]}
    job = parse(named_job_template(tmp_path, "ab"))["Resources"]
    path = job["WorkerRole"]["Properties"]["Path"]
    assert path == job["WorkerInstanceProfile"]["Properties"]["Path"] == f"/petctl/{STACK}/ab/"
    generated = f"{STACK}-job-ab-WorkerRole-" + "X" * 40  # any name: CloudFormation's, cut at 64
    for action in ("iam:DeleteRole", "iam:PutRolePolicy", "iam:DeleteRolePolicy", "iam:GetRole",
                   "iam:TagRole"):
        assert allowed(policy, action, f"{role}{path}{generated[:64]}", bounded), action
        name_only = f"{role}/{STACK}-job-ab-WorkerRole-X"
        assert not allowed(policy, action, name_only, bounded), action
        assert not allowed(policy, action, f"{role}/petctl/{STACK}-x/ab/r", bounded), action  # another stack
    assert not allowed(policy, "iam:PutRolePolicy", f"{role}{path}r")  # a role without the boundary
    assert allowed(policy, "iam:CreateRole", f"{role}{path}r", bounded)
    assert not allowed(policy, "iam:CreateRole", f"{role}{path}r", {"aws:RequestTag/petctl:stack": STACK})
    assert not allowed(policy, "iam:CreateRole", f"{role}/r", bounded)
    passed = {"iam:PassedToService": "ec2.amazonaws.com"}
    assert allowed(policy, "iam:PassRole", f"{role}{path}r", passed)
    to_lambda = {**passed, "iam:PassedToService": "lambda.amazonaws.com"}
    assert not allowed(policy, "iam:PassRole", f"{role}{path}r", to_lambda)
    assert not allowed(policy, "iam:PassRole", f"{role}/{STACK}-JobStackRole-X", passed)
    attach = {**bounded, "iam:PolicyARN": NAMES["WorkerPolicy"]}
    assert allowed(policy, "iam:AttachRolePolicy", f"{role}{path}r", attach)
    for managed in ("AdministratorAccess", "AmazonSSMManagedInstanceCore"):
        arn = f"arn:aws:iam::aws:policy/{managed}"
        context = {**bounded, "iam:PolicyARN": arn}
        assert not allowed(policy, "iam:AttachRolePolicy", f"{role}{path}r", context)
    for action in ("iam:CreateInstanceProfile", "iam:DeleteInstanceProfile", "iam:AddRoleToInstanceProfile"):
        assert allowed(policy, action, f"{profile}{path}{generated[:128]}"), action
        assert not allowed(policy, action, f"{profile}/{STACK}-job-ab-WorkerInstanceProfile-X"), action


def release_calls() -> set[str]:
    """The IAM actions of the AWS calls in petctl/agent/autoscaling.py (`client.snake_case(...)`)."""
    tree = ast.parse((ROOT / "petctl" / "agent" / "autoscaling.py").read_text())
    calls = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                node.func.value, ast.Name) and node.func.value.id in ("autoscaling", "cloudformation", "ec2",
                                                                       "iam"):
            service = node.func.value.id
            calls.add(f"{service}:" + "".join(part.title() for part in node.func.attr.split("_")))
    return calls


def worker_statements(base: dict[str, Any], job: dict[str, Any]) -> list[dict[str, Any]]:
    """Everything a worker's credentials carry: the job role's inline policy and the base stack's shared
    WorkerPolicy, its only attachment."""
    (role,) = [r for r in job["Resources"].values() if r["Type"] == "AWS::IAM::Role"]
    shared = base["Resources"]["WorkerPolicy"]["Properties"]["PolicyDocument"]
    return role_statements(role) + statements(shared)


def test_worker_role_allows_exactly_the_release_calls(base, job):
    """The group calls of autoscaling.py: the release's two and a spot notice's detach (AwsPlace). The
    detached instance ends itself by an OS shutdown, so the role holds no ec2:TerminateInstances."""
    calls = release_calls()
    assert calls == {"autoscaling:DeleteLifecycleHook", "autoscaling:UpdateAutoScalingGroup",
                     "autoscaling:DetachInstances"}
    role = next(r for r in job["Resources"].values() if r["Type"] == "AWS::IAM::Role")
    released = {a for s in role_statements(role) if s["Sid"].startswith(("ReleaseOwnGroup", "DetachOwnGroup"))
                for a in _listed(s["Action"])}  # the statements for these calls, and no more
    if not launches_spot(job):  # an on-demand job gets no spot notice, so its role cannot detach
        calls -= {"autoscaling:DetachInstances"}
    assert released == calls
    # Allowed by action here; the Allow's conditions and the conditional Denies are evaluated with the
    # call's own arguments in tests/aws/test_isolation.py (this helper ignores conditions).
    granted = [s for s in worker_statements(base, job) if s["Effect"] == "Allow"]
    assert all(allows(granted, call) for call in calls)
    assert not allows(worker_statements(base, job), "ec2:TerminateInstances")


def launches_spot(job: dict[str, Any]) -> bool:
    """The job's group launches spot instances: its launch template asks for them, or its mixed-instances
    policy puts anything above the on-demand base on spot."""
    for resource in job["Resources"].values():
        props = resource["Properties"]
        if resource["Type"] == "AWS::EC2::LaunchTemplate" and "InstanceMarketOptions" in props[
                "LaunchTemplateData"]:
            return True
        if resource["Type"] == "AWS::AutoScaling::AutoScalingGroup" and "MixedInstancesPolicy" in props:
            distribution = props["MixedInstancesPolicy"]["InstancesDistribution"]
            return int(distribution["OnDemandPercentageAboveBaseCapacity"]) < 100
    return False


def test_worker_role_can_neither_delete_a_stack_nor_pass_a_role(base, job):
    worker = worker_statements(base, job)
    for action in ("cloudformation:DeleteStack", "cloudformation:CreateStack", "cloudformation:UpdateStack",
                   "iam:PassRole", "iam:DeleteRole", "iam:DeleteRolePolicy", "ec2:DeleteLaunchTemplate"):
        assert not allows(worker, action), action
    assert not any(re.match(r"(cloudformation|iam):", a) for s in worker for a in _listed(s["Action"]))


def test_the_cli_creates_and_deletes_job_stacks_with_the_service_role():
    from petctl.providers.aws.stacks import StackOps, Template

    calls: list[tuple[str, dict]] = []

    class Cfn:
        status = "CREATE_COMPLETE"

        def describe_stacks(self, StackName):  # noqa: N803 (boto3's spelling)
            if not calls:
                from botocore.exceptions import ClientError

                raise ClientError({"Error": {"Code": "ValidationError", "Message": "does not exist"}}, "x")
            return {"Stacks": [{"StackName": StackName, "StackId": StackName, "StackStatus": self.status}]}

        def describe_stack_events(self, StackName):  # noqa: N803
            return {"StackEvents": []}

        def create_stack(self, **kw):
            calls.append(("create", kw))

        def delete_stack(self, **kw):
            calls.append(("delete", kw))
            self.status = "DELETE_COMPLETE"

    ops = StackOps(Cfn(), poll=0, progress=lambda line: None)
    ops.create("p-job-a", Template(body="{}"), {}, "job a", role_arn="arn:aws:iam::1:role/p-JobStackRole")
    ops.delete("p-job-a", "job a", role_arn="arn:aws:iam::1:role/p-JobStackRole")
    assert [(c[0], c[1]["RoleARN"]) for c in calls] == [("create", "arn:aws:iam::1:role/p-JobStackRole"),
                                                       ("delete", "arn:aws:iam::1:role/p-JobStackRole")]
