"""Give a finished job's capacity back by itself: nobody should pay for idle spot instances overnight.

Run by the one agent that recorded the job's final result (AWS only; `--keep` opts out). In order:
delete the termination lifecycle hook (otherwise every instance would wait in it for the hook's
timeout), then drop the Auto Scaling group to 0 (the instances, hence the cost, go now). The job's role
may do exactly this to its own group and nothing else (cfn/job.yaml.j2; tests/aws/test_permissions.py
checks that the policy allows exactly the calls made here).

The agent does not delete the job stack. Deleting it needs permissions the workers must not hold
(IAM role deletion, and passing the CloudFormation service role that can do it); an empty group bills
nothing, and the next CLI command that sees the job's result (`jobs`, `status`, `kill_job`, `teardown`)
deletes the stack with the base stack's service role. Failures are logged, never raised: the result is
already recorded, and `petctl kill_job` remains the manual way out.
"""

from __future__ import annotations

from typing import Any

from petctl.core.eventlog import EventLog


def release_capacity(asg_name: str, hook_name: str, region: str, log: EventLog,
                     autoscaling: Any = None) -> bool:
    """Remove the group's termination hook, then scale the group to 0. True when both calls succeeded."""
    if autoscaling is None:
        from petctl.io.aws import client

        autoscaling = client("autoscaling", profile="agent", region=region)
    steps = [
        ("delete_lifecycle_hook", lambda: autoscaling.delete_lifecycle_hook(
            AutoScalingGroupName=asg_name, LifecycleHookName=hook_name)),
        ("scale_to_zero", lambda: autoscaling.update_auto_scaling_group(
            AutoScalingGroupName=asg_name, MinSize=0, DesiredCapacity=0)),
    ]
    ok = True
    for name, call in steps:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - a missing hook is fine; a denied call is a line, not a crash
            ok = False
            log.emit("release.step_failed", step=name, error=f"{type(e).__name__}: {e}"[:300])
    log.emit("release.done" if ok else "release.partial", asg=asg_name)
    return ok
