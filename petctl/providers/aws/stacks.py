"""Create, update, wait for and delete CloudFormation stacks, reporting progress as CloudFormation works
and failing with the stack's own reason (the first resource that failed), not a generic waiter error.

A template reaches CloudFormation as a `Template`: inline (TemplateBody, 51,200 bytes at most: only the
base stack's seed) or by URL (TemplateURL: every full template, uploaded first to the stack's own bucket by
`publish`). CloudFormation reads a TemplateURL with the caller's credentials, so the bucket stays private:
its policy grants CloudFormation nothing, and the caller needs s3:GetObject on the object (AWS's user guide:
"stored in an S3 bucket that you have read permissions to"; docs/aws.md says what only an account shows).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from petctl.core.errors import JobExists, ProviderError
from petctl.io.aws import aws_errors, error_message
from petctl.providers.aws.templates import TEMPLATE_BODY_LIMIT, TEMPLATE_URL_LIMIT, TEMPLATE_URL_MAX_CHARS

Progress = Callable[[str], None]

IN_PROGRESS = "_IN_PROGRESS"
DONE_OK = {"CREATE_COMPLETE", "UPDATE_COMPLETE", "DELETE_COMPLETE", "IMPORT_COMPLETE"}
CAPABILITIES = ["CAPABILITY_IAM"]


@dataclass(frozen=True)
class Template:
    """A template as CloudFormation is given it: `url` (TemplateURL) when set, else `body` inline."""

    body: str = ""
    url: str = ""

    def args(self) -> dict[str, str]:
        """The CreateStack/UpdateStack argument. Raises ProviderError for an inline body over
        CloudFormation's limit (say so here, rather than as the API's ValidationError)."""
        if self.url:
            return {"TemplateURL": self.url}
        size = len(self.body.encode())
        if size > TEMPLATE_BODY_LIMIT:
            raise ProviderError(f"a template of {size} bytes cannot go inline (CloudFormation's TemplateBody "
                                f"limit is {TEMPLATE_BODY_LIMIT}): publish it to the bucket")
        return {"TemplateBody": self.body}


def template_key(prefix: str, name: str, body: str) -> str:
    """Where a template is kept in the bucket: named by its content, so a stack's template never changes
    under it and the same template is one object."""
    return f"{prefix}/{name}-{hashlib.sha256(body.encode()).hexdigest()[:16]}.yaml"


def template_url(bucket: str, region: str, key: str) -> str:
    """The TemplateURL of an object: the bucket's regional virtual-hosted https address (CloudFormation
    takes only https:// S3 URLs, not website ones; `.com.cn` in the China regions). Raises ProviderError
    when it is longer than CloudFormation accepts."""
    from urllib.parse import quote

    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    url = f"https://{bucket}.s3.{region}.{suffix}/{quote(key)}"
    if len(url) > TEMPLATE_URL_MAX_CHARS:
        raise ProviderError(f"the template URL is {len(url)} characters (CloudFormation takes at most "
                            f"{TEMPLATE_URL_MAX_CHARS}): {url[:80]}...")
    return url


def publish(s3: Any, bucket: str, region: str, key: str, body: str) -> Template:
    """Upload a template to the stack's bucket and return it as a TemplateURL. Raises ProviderError for a
    template over CloudFormation's 1 MB, or when the upload fails (one line, naming the object)."""
    size = len(body.encode())
    if size > TEMPLATE_URL_LIMIT:
        raise ProviderError(f"the template is {size} bytes: over CloudFormation's {TEMPLATE_URL_LIMIT}-byte "
                            "limit for a template in S3")
    url = template_url(bucket, region, key)
    with aws_errors(f"upload the template to s3://{bucket}/{key}"):
        s3.put_object(Bucket=bucket, Key=key, Body=body.encode(), ContentType="text/yaml")
    return Template(url=url)


def _role(role_arn: str) -> dict[str, str]:
    return {"RoleARN": role_arn} if role_arn else {}


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class StackOps:
    """Stack operations on one CloudFormation client. `poll` is seconds between status checks."""

    cfn: Any
    poll: float = 5.0
    timeout: float = 3600.0
    progress: Progress = stderr_progress
    _seen_events: set[str] = field(default_factory=set)

    def describe(self, name: str) -> dict[str, Any] | None:
        """The stack, or None when it does not exist (deleted stacks are invisible by name)."""
        from petctl.io.aws import ClientError

        with aws_errors(f"describe stack {name}"):
            try:
                return self.cfn.describe_stacks(StackName=name)["Stacks"][0]
            except ClientError as exc:
                if "does not exist" in error_message(exc):
                    return None
                raise

    def outputs(self, name: str) -> dict[str, str]:
        stack = self.describe(name) or {}
        return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}

    def list_stacks(self, tag_key: str, tag_value: str) -> list[dict[str, Any]]:
        """Live stacks carrying the tag (CloudFormation has no server-side tag filter)."""
        stacks = []
        with aws_errors("list stacks"):
            for page in self.cfn.get_paginator("describe_stacks").paginate():
                for stack in page["Stacks"]:
                    tags = {t["Key"]: t["Value"] for t in stack.get("Tags", [])}
                    if tags.get(tag_key) == tag_value and stack["StackStatus"] != "DELETE_COMPLETE":
                        stacks.append(stack)
        return stacks

    def create(self, name: str, template: Template, tags: dict[str, str], what: str,
               role_arn: str = "") -> dict[str, Any]:
        """Create a stack that must not exist yet, and wait for it. `role_arn`: the CloudFormation service
        role to create (and later update and delete) it with, instead of the caller's permissions. Raises
        JobExists when it exists, ProviderError when it fails (with the first resource's reason)."""
        existing = self.describe(name)
        if existing:
            raise JobExists(self._exists_message(name, existing["StackStatus"], what))
        with aws_errors(f"create stack {name}"):
            self.cfn.create_stack(StackName=name, **template.args(), Capabilities=CAPABILITIES,
                                  Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
                                  OnFailure="ROLLBACK", **_role(role_arn))
        self.progress(f"creating {what} (stack {name})")
        return self.wait(name, "CREATE_COMPLETE")

    def create_or_update(self, name: str, template: Template, tags: dict[str, str],
                         what: str) -> dict[str, Any]:
        """setup is idempotent: create the stack, or update it in place when it is already healthy. Raises
        JobExists when it is busy or failed to delete, ProviderError when the operation fails."""
        from petctl.io.aws import ClientError

        existing = self.describe(name)
        if existing is not None and existing["StackStatus"] == "ROLLBACK_COMPLETE":
            # A first creation that failed leaves an empty stack that can only be deleted: do it, then retry.
            self.progress(f"removing the failed earlier attempt at {what} (stack {name})")
            self.delete(name, what)
            existing = None
        if existing is None:
            return self.create(name, template, tags, what)
        status = existing["StackStatus"]
        if status.endswith(IN_PROGRESS) or status == "DELETE_FAILED":
            raise JobExists(self._exists_message(name, status, what))
        with aws_errors(f"update stack {name}"):
            try:
                self.cfn.update_stack(StackName=name, **template.args(), Capabilities=CAPABILITIES,
                                      Tags=[{"Key": k, "Value": v} for k, v in tags.items()])
            except ClientError as exc:
                if "No updates are to be performed" in error_message(exc):
                    self.progress(f"{what} is up to date (stack {name})")
                    return existing
                raise
        self.progress(f"updating {what} (stack {name})")
        return self.wait(name, "UPDATE_COMPLETE")

    def delete(self, name: str, what: str, role_arn: str = "") -> None:
        """Delete a stack and wait until it is gone (with `role_arn`, as that service role)."""
        if self.start_delete(name, role_arn):
            self.progress(f"deleting {what} (stack {name})")
            self.wait(name, "DELETE_COMPLETE")

    def start_delete(self, name: str, role_arn: str = "") -> bool:
        """Ask CloudFormation to delete a stack without waiting; False when there is no such stack."""
        if self.describe(name) is None:
            return False
        with aws_errors(f"delete stack {name}"):
            self.cfn.delete_stack(StackName=name, **_role(role_arn))
        return True

    def wait(self, name: str, target: str) -> dict[str, Any]:
        """Poll until the stack settles; print each new resource event; raise with the failure reason."""
        stack_id = (self.describe(name) or {}).get("StackId", name)
        deadline = time.monotonic() + self.timeout
        while True:
            self._report_events(stack_id)
            stack = self._describe_id(stack_id)
            status = stack["StackStatus"] if stack else "DELETE_COMPLETE"
            if not status.endswith(IN_PROGRESS):
                if status == target or (target == "DELETE_COMPLETE" and stack is None):
                    return stack or {}
                raise ProviderError(f"stack {name} ended {status}: {self.failure_reason(stack_id, stack)}")
            if time.monotonic() > deadline:
                raise ProviderError(f"stack {name} still {status} after {self.timeout:.0f}s; see the "
                                    "CloudFormation console for details")
            time.sleep(self.poll)

    def failure_reason(self, stack_id: str, stack: dict[str, Any] | None) -> str:
        """The first resource failure of the latest operation: the cause, not the rollback's echo."""
        reasons = []
        for event in self._events(stack_id):
            if event.get("ResourceStatus", "").endswith("_FAILED") and event.get("ResourceStatusReason"):
                if event.get("ResourceType") != "AWS::CloudFormation::Stack":
                    reasons.append(f"{event['LogicalResourceId']}: {event['ResourceStatusReason']}")
        if reasons:
            return reasons[-1]  # events are newest first; the last failure listed happened first
        return (stack or {}).get("StackStatusReason") or "no reason given by CloudFormation"

    def _describe_id(self, stack_id: str) -> dict[str, Any] | None:
        from petctl.io.aws import ClientError

        with aws_errors(f"describe stack {stack_id}"):
            try:
                stack = self.cfn.describe_stacks(StackName=stack_id)["Stacks"][0]
            except ClientError as exc:
                if "does not exist" in error_message(exc):
                    return None
                raise
        return None if stack["StackStatus"] == "DELETE_COMPLETE" else stack

    def _events(self, stack_id: str) -> list[dict[str, Any]]:
        from petctl.io.aws import ClientError

        with aws_errors(f"read events of stack {stack_id}"):
            try:
                return list(self.cfn.describe_stack_events(StackName=stack_id).get("StackEvents", []))
            except ClientError as exc:
                if "does not exist" in error_message(exc):
                    return []
                raise

    def _report_events(self, stack_id: str) -> None:
        for event in reversed(self._events(stack_id)):
            if event["EventId"] in self._seen_events:
                continue
            self._seen_events.add(event["EventId"])
            reason = f" - {event['ResourceStatusReason']}" if event.get("ResourceStatusReason") else ""
            self.progress(f"  {event.get('ResourceStatus', ''):<20} {event.get('ResourceType', ''):<40} "
                          f"{event.get('LogicalResourceId', '')}{reason}")

    @staticmethod
    def _exists_message(name: str, status: str, what: str) -> str:
        if status.startswith("DELETE"):
            return f"stack {name} ({what}) is being deleted ({status}); wait for it to finish and retry"
        if status.endswith(IN_PROGRESS):
            return f"stack {name} ({what}) is busy ({status}); wait for it to finish and retry"
        if status == "ROLLBACK_COMPLETE":
            return (f"stack {name} ({what}) failed to create earlier (ROLLBACK_COMPLETE); delete it "
                    "(petctl kill_job / teardown) and retry")
        if status == "DELETE_FAILED":
            return (f"stack {name} ({what}) failed to delete (DELETE_FAILED); see its events in the "
                    "CloudFormation console, fix the cause and run petctl teardown again")
        return f"stack {name} ({what}) already exists ({status})"
