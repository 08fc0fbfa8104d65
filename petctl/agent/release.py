"""Give a finished job's capacity back by itself: nobody should pay for idle spot instances overnight.

Run by the one agent that recorded the job's final result (AWS only; `--keep` opts out). In order:
delete the termination lifecycle hook (otherwise every instance would wait in it for the hook's
timeout), drop the Auto Scaling group to 0 (the instances, hence the cost, go now), then delete the job
stack (role, launch template, group). The job's role may do exactly this to its own resources and
nothing else (cfn/job.yaml.j2). Failures are logged, never raised: the result is already recorded, and
`petctl kill_job` remains the manual way out.
"""

from __future__ import annotations

from typing import Any

from petctl.eventlog import EventLog


def release_capacity(stack_name: str, asg_name: str, hook_name: str, region: str, log: EventLog,
                     autoscaling: Any = None, cloudformation: Any = None) -> bool:
    if autoscaling is None or cloudformation is None:
        import boto3

        session = boto3.session.Session(region_name=region or None)
        autoscaling = autoscaling or session.client("autoscaling")
        cloudformation = cloudformation or session.client("cloudformation")
    steps = [
        ("delete_lifecycle_hook", lambda: autoscaling.delete_lifecycle_hook(
            AutoScalingGroupName=asg_name, LifecycleHookName=hook_name)),
        ("scale_to_zero", lambda: autoscaling.update_auto_scaling_group(
            AutoScalingGroupName=asg_name, MinSize=0, DesiredCapacity=0)),
        ("delete_stack", lambda: cloudformation.delete_stack(StackName=stack_name)),
    ]
    ok = True
    for name, call in steps:
        try:
            call()
        except Exception as e:  # a missing hook is fine; a denied call is worth a line, not a crash
            ok = False
            log.emit("release.step_failed", step=name, error=f"{type(e).__name__}: {e}"[:300])
    log.emit("release.done" if ok else "release.partial", stack=stack_name, asg=asg_name)
    return ok
