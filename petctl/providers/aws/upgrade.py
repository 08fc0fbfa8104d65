"""Whether `petctl setup` may update a base stack under the jobs it has: not under a job of an older layout.

Since issue 17 every job's IAM role and instance profile live under the job's own IAM path
(`/petctl/<stack>/<job>/`, jobscope.py), and the base stack's CloudFormation service role, which creates
and deletes job stacks, may touch only roles under `/petctl/<stack>/`. A job stack created by an earlier
petctl has its role at path `/`: once the base stack is updated, that service role is denied
`iam:DeleteRole` on it, so `kill_job` would leave the stack in DELETE_FAILED and the job's instances
running. So `setup` refuses the update while such a job stack exists and says which to kill first, while
the old service role can still delete them; nothing is changed before that check.

Since issue 24 every job role also has the base stack's JobBoundary as its permissions boundary, and the
service role may change a role's policies (DeleteRolePolicy, DetachRolePolicy: what deleting a job stack
does) only on a role with that boundary: a job stack from before it is refused the same way.

Each job stack records its layout in the `petctl:layout` tag; a stack without it predates the tag.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from petctl.core.errors import JobExists
from petctl.providers.aws import jobrecords

LAYOUT_TAG = "petctl:layout"
# the job's role and profile under /petctl/<stack>/<job>/ (jobscope.py), the role bounded by JobBoundary
LAYOUT = "job-iam-boundary"


def layout_tags() -> dict[str, str]:
    """The tag every new job stack carries."""
    return {LAYOUT_TAG: LAYOUT}


def outdated_jobs(job_stacks: Iterable[dict[str, Any]]) -> list[str]:
    """The jobs (sorted names) whose stacks were made with another layout than this petctl's."""
    names = []
    for stack in job_stacks:
        tags = jobrecords.tags(stack)
        if tags.get(LAYOUT_TAG) != LAYOUT:
            names.append(tags.get("petctl:job", stack.get("StackName", "?")))
    return sorted(names)


def check_upgrade(job_stacks: Iterable[dict[str, Any]]) -> None:
    """Raises JobExists (one line, naming them) when a job stack of an older layout exists."""
    old = outdated_jobs(job_stacks)
    if old:
        raise JobExists(
            f"{len(old)} job(s) were started by an earlier petctl ({', '.join(old)}) whose IAM roles the "
            "updated base stack could no longer delete: kill them first (`petctl kill_job NAME`; "
            "checkpoints stay in the bucket), then run setup again")
