"""A finished job gives its capacity back by itself (issue: nobody pays for idle instances).

moto neither enforces IAM nor runs lifecycle hooks, so: the permissions are asserted on the rendered
template (scoped to the job's own group, stack, role and launch template; absent with --keep), and the
release sequence against recording clients (order, arguments, a failing step logged, not raised).
"""

from __future__ import annotations

import io
import json

from petctl.agent.release import release_capacity
from petctl.eventlog import EventLog
from petctl.providers.aws.provider import LIFECYCLE_HOOK
from petctl.spec import AgentConfig
from tests.aws.rendered import BUCKET, STACK, job_spec, parse, provider


def render(tmp_path, keep: bool) -> dict:
    spec = job_spec("spot-single")
    spec.keep = keep
    agent = AgentConfig(job=spec, node_id="", asg_name=f"{STACK}-job-spot-single",
                        lifecycle_hook=LIFECYCLE_HOOK, region="us-east-1",
                        status_url=f"s3://{BUCKET}/jobs/spot-single/")
    rendered = provider(tmp_path).render_job_template(spec, agent, f"s3://{BUCKET}/jobs/spot-single/agent.json")
    return parse(rendered)


def statements(template: dict) -> dict[str, dict]:
    role = template["Resources"]["WorkerRole"]["Properties"]
    return {s["Sid"]: s for p in role["Policies"] for s in p["PolicyDocument"]["Statement"]}


def test_job_role_may_release_only_its_own_capacity(tmp_path):
    stmts = statements(render(tmp_path, keep=False))
    own = f"{STACK}-job-spot-single"
    group = json.dumps(stmts["ReleaseOwnGroup"]["Resource"])
    assert group.endswith(f'autoScalingGroupName/{own}"}}')
    assert f"stack/{own}/*" in json.dumps(stmts["DeleteOwnStack"]["Resource"])
    assert stmts["DeleteOwnStack"]["Action"] == "cloudformation:DeleteStack"
    lt = stmts["DeleteOwnLaunchTemplate"]
    assert lt["Action"] == "ec2:DeleteLaunchTemplate"
    assert lt["Condition"]["StringEquals"]["aws:ResourceTag/petctl:job"] == "spot-single"
    roles = json.dumps(stmts["DeleteOwnRoleAndProfile"]["Resource"])
    assert f"role/{own}-*" in roles and f"instance-profile/{own}-*" in roles
    for s in stmts.values():
        assert s["Effect"] == "Allow" and "*" not in json.dumps(s["Action"])


def test_keep_renders_no_release_permission(tmp_path):
    stmts = statements(render(tmp_path, keep=True))
    assert not {"ReleaseOwnGroup", "DeleteOwnStack", "DeleteOwnLaunchTemplate",
                "DeleteOwnRoleAndProfile"} & set(stmts)


def test_launch_template_is_tagged_for_the_scoped_delete(tmp_path):
    lt = next(r for r in render(tmp_path, keep=False)["Resources"].values()
              if r["Type"] == "AWS::EC2::LaunchTemplate")["Properties"]
    (spec,) = lt["TagSpecifications"]
    assert spec["ResourceType"] == "launch-template"
    assert {"Key": "petctl:job", "Value": "spot-single"} in spec["Tags"]


class Recorder:
    def __init__(self, calls: list, fail: str = ""):
        self.calls, self.fail = calls, fail

    def __getattr__(self, name):
        def call(**kwargs):
            self.calls.append((name, kwargs))
            if name == self.fail:
                raise RuntimeError("AccessDenied")
        return call


def test_release_hook_then_group_then_stack():
    calls: list = []
    out = io.StringIO()
    ok = release_capacity("st-job-a", "st-job-a", "hook", "us-east-1", EventLog("agent", stream=out),
                          autoscaling=Recorder(calls), cloudformation=Recorder(calls))
    assert ok
    assert [c[0] for c in calls] == ["delete_lifecycle_hook", "update_auto_scaling_group", "delete_stack"]
    assert calls[1][1] == {"AutoScalingGroupName": "st-job-a", "MinSize": 0, "DesiredCapacity": 0}
    assert calls[2][1] == {"StackName": "st-job-a"}
    assert '"event":"release.done"' in out.getvalue()


def test_a_denied_step_is_logged_and_the_rest_still_runs():
    calls: list = []
    out = io.StringIO()
    ok = release_capacity("st-job-a", "st-job-a", "hook", "us-east-1", EventLog("agent", stream=out),
                          autoscaling=Recorder(calls, fail="delete_lifecycle_hook"),
                          cloudformation=Recorder(calls))
    assert not ok
    assert [c[0] for c in calls] == ["delete_lifecycle_hook", "update_auto_scaling_group", "delete_stack"]
    assert "release.step_failed" in out.getvalue() and "AccessDenied" in out.getvalue()
