"""What one job's credentials may reach, as names: its IAM path, its S3 prefix and what it may write there,
its log streams and its Auto Scaling group's ARN. The job template (cfn/job.yaml.j2) scopes the workers'
role with these, and the base template scopes the CloudFormation service role by the same path.

Every scope ends in a separator ("/" in paths and prefixes, the end of the group's name in its ARN), so
that job `a` never matches job `a-b`: a name prefix without one would. IAM paths are also why long job
names are harmless: CloudFormation cuts the names it generates at 64 characters, but a role's path is
ours (up to 512 characters) and the service role matches on it, not on the name.
"""

from __future__ import annotations

from petctl.providers.aws.etcdsecrets import USERS_INDEX, jobs_prefix
from petctl.providers.aws.storage import job_prefix

# What a job writes under its prefix (petctl/agent/reporting.py, petctl.elastic's checkpointers); the rest of
# the prefix (code/, agent.json, job.json, placement.json) is written by the CLI and only read by the job.
# boots/: each instance's boot records (petctl/core/boots.py), written by its boot script and its agent.
JOB_WRITABLE = ("checkpoints/*", "status/*", "events/*", "logs/*", "boots/*", "result.json")
GROUP_ARN = ("arn:${AWS::Partition}:autoscaling:${AWS::Region}:${AWS::AccountId}:autoScalingGroup:*:"
             "autoScalingGroupName/")


def iam_path(stack: str) -> str:
    """The IAM path of every role and instance profile of one installation's job stacks."""
    return f"/petctl/{stack}/"


def job_iam_path(stack: str, job: str) -> str:
    """One job's IAM path, inside its installation's."""
    return f"{iam_path(stack)}{job}/"


def log_stream_prefix(job: str) -> str:
    """The job's CloudWatch Logs streams are `<job>/<instance id>` in the stack's log group."""
    return f"{job}/"


def group_arn(group_name: str) -> str:
    """The Auto Scaling group's ARN as a `Fn::Sub` string (its id is a wildcard: it is AWS's)."""
    return GROUP_ARN + group_name


def base_scope(stack: str) -> dict[str, object]:
    """The base template's variables for its CloudFormation service role's IAM scope (`Fn::Sub` strings)
    and for the job roles' permissions boundary: every job's scope, with the job's name a wildcard."""
    arn = "arn:${AWS::Partition}:iam::${AWS::AccountId}"
    return {"job_iam_path": iam_path(stack), "job_role_arns": f"{arn}:role{iam_path(stack)}*",
            "job_profile_arns": f"{arn}:instance-profile{iam_path(stack)}*", "job_writable": JOB_WRITABLE,
            "any_job_prefix": job_prefix("*"), "any_job_group_arn": group_arn(f"{stack}-job-*"),
            "any_job_secret": f"{jobs_prefix(stack)}*", "users_index": USERS_INDEX}


def template_scope(stack: str, job: str, group_name: str, log_group: str) -> dict[str, object]:
    """The job template's variables for its role's scope."""
    return {"iam_path": job_iam_path(stack, job), "job_prefix": job_prefix(job), "job_writable": JOB_WRITABLE,
            "log_group": log_group, "log_stream_prefix": log_stream_prefix(job),
            "group_arn": group_arn(group_name)}
