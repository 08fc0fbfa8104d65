"""A finished job gives its capacity back by itself (issue: nobody pays for idle instances).

moto neither enforces IAM nor runs lifecycle hooks, so: the permissions are asserted on the rendered
template (scoped to the job's own group; with --keep only the boot breaker's scale to 0;
tests/aws/test_permissions.py checks them against the calls agent.py makes), and the release sequence
against recording clients (order, arguments, a failing step logged, not raised). The stack itself is
deleted by the CLI, not the agent.
"""

from __future__ import annotations

import io
import json

from petctl.agent.autoscaling import release_capacity
from petctl.core.spec import AgentConfig
from petctl.io.eventlog import EventLog
from petctl.providers.aws.launch import LIFECYCLE_HOOK
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


def test_job_role_may_release_only_its_own_group(tmp_path):
    stmts = statements(render(tmp_path, keep=False))
    own = f"{STACK}-job-spot-single"
    for sid in ("ReleaseOwnGroupHook", "ReleaseOwnGroupToZero"):
        assert json.dumps(stmts[sid]["Resource"]).endswith(f'autoScalingGroupName/{own}"}}')
    assert stmts["ReleaseOwnGroupHook"]["Action"] == "autoscaling:DeleteLifecycleHook"
    assert stmts["ReleaseOwnGroupToZero"]["Action"] == "autoscaling:UpdateAutoScalingGroup"
    # only to 0 (issue 17.4; evaluated in tests/aws/test_isolation.py)
    assert stmts["ReleaseOwnGroupToZero"]["Condition"] == {
        "NumericEquals": {"autoscaling:MinSize": "0", "autoscaling:MaxSize": "0"}}
    assert not {"DeleteOwnStack", "DeleteOwnLaunchTemplate", "DeleteOwnRoleAndProfile"} & set(stmts)
    for s in stmts.values():
        assert "*" not in json.dumps(s["Action"])
        assert s["Effect"] == "Allow" or s["Action"] == "autoscaling:UpdateAutoScalingGroup"


def test_keep_renders_no_hook_release_only_the_boot_breakers_stop(tmp_path):
    """--keep: the finished job's agent does not release its capacity (agent.py skips the release), so
    its role cannot delete the termination hook; it keeps the scale-to-0 statement (with its guards)
    because the boot breaker must be able to stop a group whose boots never join: a kept job keeps its
    instances, never a boot loop (issue 24; the conditions are evaluated in test_isolation.py)."""
    kept, released = statements(render(tmp_path, keep=True)), statements(render(tmp_path, keep=False))
    assert "ReleaseOwnGroupHook" not in kept and "ReleaseOwnGroupHook" in released
    assert not [sid for sid, s in kept.items() if "DeleteLifecycleHook" in json.dumps(s["Action"])]
    for sid in ("ReleaseOwnGroupToZero", *[sid for sid in released if sid.startswith("NoGroupChange")]):
        assert kept[sid] == released[sid], sid


def test_launch_template_is_tagged_with_its_job(tmp_path):
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


def test_release_removes_the_hook_then_empties_the_group_and_leaves_the_stack():
    calls: list = []
    out = io.StringIO()
    ok = release_capacity("st-job-a", "hook", "us-east-1", EventLog("agent", stream=out),
                          autoscaling=Recorder(calls))
    assert ok
    assert [c[0] for c in calls] == ["delete_lifecycle_hook", "update_auto_scaling_group"]
    assert calls[0][1] == {"AutoScalingGroupName": "st-job-a", "LifecycleHookName": "hook"}
    assert calls[1][1] == {"AutoScalingGroupName": "st-job-a", "MinSize": 0, "MaxSize": 0,
                           "DesiredCapacity": 0}
    assert '"event":"release.done"' in out.getvalue()


def test_a_denied_step_is_logged_and_the_rest_still_runs():
    calls: list = []
    out = io.StringIO()
    ok = release_capacity("st-job-a", "hook", "us-east-1", EventLog("agent", stream=out),
                          autoscaling=Recorder(calls, fail="delete_lifecycle_hook"))
    assert not ok
    assert [c[0] for c in calls] == ["delete_lifecycle_hook", "update_auto_scaling_group"]
    assert "release.step_failed" in out.getvalue() and "AccessDenied" in out.getvalue()
