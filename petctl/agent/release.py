"""Give a finished job's capacity back by itself: nobody should pay for idle spot instances overnight.

Run by the one agent that recorded the job's final result (AWS only; `--keep` opts out). In order:
delete the termination lifecycle hook (otherwise every instance would wait in it for the hook's
timeout), then drop the Auto Scaling group to 0 (the instances, hence the cost, go now) by setting its
MinSize and MaxSize to 0: the job's role may call UpdateAutoScalingGroup on its own group only with
both at 0 (cfn/job.yaml.j2: IAM has condition keys for MinSize and MaxSize, none for DesiredCapacity),
so job code holding the same credentials can shrink its own group but never grow it. A MaxSize of 0
takes the desired capacity to 0 with it (AWS: a maximum below the group's size sets the desired
capacity to it); DesiredCapacity=0 is sent too, which AWS accepts only because it is within [0, 0].
tests/aws/test_permissions.py checks that the policy allows exactly the calls made here, and
tests/aws/test_isolation.py evaluates them against the policy's conditions.

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
            AutoScalingGroupName=asg_name, MinSize=0, MaxSize=0, DesiredCapacity=0)),
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
