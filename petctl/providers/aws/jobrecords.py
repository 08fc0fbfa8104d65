"""Which jobs exist on AWS and how they stand: from their stacks while those exist, and from the
records in their S3 prefix (job.json, result.json) once the stacks are gone.

`result.json` decides a job's end whenever it exists (written by the agent that ended the job, or by
kill_job), so a job that succeeded stays succeeded while, and after, its stack is deleted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from petctl.core.errors import JobNotFound
from petctl.core.records import JobResult
from petctl.io.aws import AwsSession
from petctl.jobview.live import mirror_result
from petctl.providers.aws import etcdsecrets, inventory
from petctl.providers.aws.storage import recorded_jobs
from petctl.providers.base import JobInfo

if TYPE_CHECKING:
    from petctl.providers.aws.context import AwsContext
    from petctl.providers.aws.stacks import StackOps


def tags(stack: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in stack.get("Tags", [])}


def job_stacks(stacks: StackOps, base_stack: str) -> list[dict[str, Any]]:
    """The live job stacks of one installation (tagged with its base stack and kind `job`)."""
    return [s for s in stacks.list_stacks("petctl:stack", base_stack) if tags(s).get("petctl:kind") == "job"]


def job_info(provider: AwsContext, name: str) -> JobInfo:
    """One job, from its stack (and its result), or from its S3 record once the stack is gone.
    Raises JobNotFound."""
    provider.require_ready()
    session = provider.session()
    stack = provider.stacks(session).describe(provider.job_stack(name))
    if not stack or stack["StackStatus"] == "DELETE_COMPLETE":
        recorded = recorded_job(provider, session, name)
        if recorded is None:
            raise JobNotFound(f"no job {name!r} (see `petctl jobs`)")
        return recorded
    info = inventory.job_info(session.client("autoscaling"), stack, provider.name)
    result = mirror_result(provider.store(session, name))
    reap(provider, session, stack, result)
    return inventory.apply_result(info, result)


def list_jobs(provider: AwsContext) -> list[JobInfo]:
    """Jobs with a stack, and finished ones whose stack is gone (from their S3 record)."""
    settings = provider.require_ready()
    session = provider.session()
    stacks = job_stacks(provider.stacks(session), provider.base_stack)
    infos = []
    for stack in stacks:
        info = inventory.job_info(session.client("autoscaling"), stack, provider.name)
        result = mirror_result(provider.store(session, info.name))
        infos.append(inventory.apply_result(info, result))
        reap(provider, session, stack, result)
    live = {i.name for i in infos}
    for name in recorded_jobs(session.client("s3"), settings["outputs"]["BucketName"]):
        if name not in live and (info := recorded_job(provider, session, name)) is not None:
            infos.append(info)
    return sorted(infos, key=lambda i: i.created_at)


def recorded_job(provider: AwsContext, session: AwsSession, name: str) -> JobInfo | None:
    """A job whose stack is gone, from its S3 record (None when there is none)."""
    store = provider.store(session, name)
    record = store.record()
    if record is None:
        return None
    spec, result = record["spec"], mirror_result(store)
    return JobInfo(name=name, state=result.state if result else "ended", min_size=spec.get("min_size", 0),
                   max_size=spec.get("max_size", 0), desired=0, created_at=record["created_at"],
                   provider=provider.name, reason=result.reason if result else "its stack is gone",
                   extra={"stack": None, "ended_at": result.ts if result else None})


def reap(provider: AwsContext, session: AwsSession, stack: dict[str, Any], result: JobResult | None) -> None:
    """A job whose result.json records its end, and whose stack still exists, gets its stack deleted
    (its agent already scaled the group to 0 and may not delete the stack itself). Not waited for."""
    if result is None or not inventory.ended(result) or stack["StackStatus"] == "DELETE_IN_PROGRESS":
        return
    job = tags(stack).get("petctl:job", stack["StackName"])
    role = provider.settings.get("outputs", {}).get("JobStackRoleArn", "")
    if not role:  # a base stack from before the service role: listing must still work
        provider.progress(f"job {job} ended ({result.state}); run `petctl setup --provider aws` again "
                          f"so petctl can delete its stack {stack['StackName']}")
        return
    provider.progress(f"job {job} ended ({result.state}): deleting its stack {stack['StackName']}")
    provider.stacks(session).start_delete(stack["StackName"], role)
    delete_credentials(provider, session, job)


def ended_stack(provider: AwsContext, session: AwsSession, stack: dict[str, Any]) -> bool:
    """Whether the job of this stack has ended (its result.json says so)."""
    job = tags(stack).get("petctl:job", "")
    return bool(job) and bool(provider.settings.get("outputs", {}).get("BucketName")) and inventory.ended(
        mirror_result(provider.store(session, job)))


def kill(provider: AwsContext, name: str) -> None:
    """Delete the job's stack (its Auto Scaling group and role); its S3 prefix stays (checkpoints).

    The job's end is recorded first (result.json), unless it already ended: its own result stands."""
    provider.require_ready()
    session = provider.session()
    stacks = provider.stacks(session)
    store = provider.store(session, name)
    result = mirror_result(store)
    if not stacks.describe(provider.job_stack(name)):
        if result is not None and inventory.ended(result):  # ended, its stack deleted: nothing to remove
            provider.progress(f"job {name} already ended ({result.state}); its capacity is gone")
            return
        raise JobNotFound(f"no job {name!r} (see `petctl jobs`)")
    if result is None:
        info = job_info(provider, name)
        ended = info.state in ("succeeded", "failed")
        store.put_json("result.json", JobResult(
            state=info.state if ended else "killed", reason=info.reason if ended else "petctl kill_job",
            ts=time.time(), job=name, node="cli").to_dict())
    stacks.delete(provider.job_stack(name), f"job {name}", provider.stack_role())
    # Its etcd credentials: the etcd hosts delete its users once their index entries are gone.
    delete_credentials(provider, session, name)


def delete_credentials(provider: AwsContext, session: AwsSession, job: str) -> None:
    """The job's etcd credentials: its users' index entries in the bucket, then its secrets."""
    bucket = provider.settings.get("outputs", {}).get("BucketName", "")
    etcdsecrets.delete_job_credentials(session.client("secretsmanager"), session.client("s3"), bucket,
                                       provider.base_stack, job)
