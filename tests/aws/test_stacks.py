"""Stack waits and AWS errors in user terms. moto completes every stack at once and never throttles, so
these states (a failed resource, a stack being deleted, throttling) come from a small stub client."""

from __future__ import annotations

import datetime as dt

import pytest
from botocore.exceptions import ClientError

from petctl.core.errors import JobExists, NotSetUp, ProviderError
from petctl.io.aws import aws_errors
from petctl.providers.aws.stacks import StackOps, Template


class StubCfn:
    """describe_stacks walks through `statuses`; events are returned newest first, as AWS does."""

    def __init__(self, statuses: list[str], events: list[dict] | None = None, exists: bool = True) -> None:
        self.statuses = list(statuses)
        self.events = events or []
        self.exists = exists
        self.calls: list[str] = []

    def describe_stacks(self, StackName: str):  # noqa: N803 (boto3's argument names)
        self.calls.append("describe_stacks")
        if not self.exists:
            raise ClientError(
                {
                    "Error": {
                        "Code": "ValidationError",
                        "Message": f"Stack with id {StackName} does not exist",
                    }
                },
                "DescribeStacks",
            )
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return {
            "Stacks": [
                {
                    "StackName": StackName,
                    "StackId": f"arn:stack/{StackName}",
                    "StackStatus": status,
                    "CreationTime": dt.datetime.now(dt.timezone.utc),
                }
            ]
        }

    def describe_stack_events(self, StackName: str):  # noqa: N803
        return {"StackEvents": list(reversed(self.events))}

    def create_stack(self, **kwargs):
        self.calls.append("create_stack")


def event(n: int, logical: str, status: str, reason: str = "", kind: str = "AWS::EC2::VPC") -> dict:
    return {
        "EventId": str(n),
        "LogicalResourceId": logical,
        "ResourceStatus": status,
        "ResourceType": kind,
        "ResourceStatusReason": reason,
    }


def test_wait_fails_with_the_first_resource_failure_not_the_rollback_echo():
    events = [
        event(1, "Vpc", "CREATE_IN_PROGRESS"),
        event(
            2,
            "Group",
            "CREATE_FAILED",
            "You have requested more vCPU capacity than your current vCPU "
            "limit of 0 allows (VcpuLimitExceeded)",
            "AWS::AutoScaling::AutoScalingGroup",
        ),
        event(3, "LaunchTemplate", "CREATE_FAILED", "Resource creation cancelled"),
        event(
            4,
            "job",
            "ROLLBACK_COMPLETE",
            "The following resource(s) failed to create: [Group]",
            "AWS::CloudFormation::Stack",
        ),
    ]
    lines: list[str] = []
    ops = StackOps(
        StubCfn(["CREATE_IN_PROGRESS", "ROLLBACK_IN_PROGRESS", "ROLLBACK_COMPLETE"], events),
        poll=0,
        progress=lines.append,
    )
    with pytest.raises(
        ProviderError,
        match=r"stack job ended ROLLBACK_COMPLETE: Group: You have requested more "
        r"vCPU capacity",
    ):
        ops.wait("job", "CREATE_COMPLETE")
    assert any(
        "CREATE_FAILED" in line and "Group" in line for line in lines
    )  # progress as CloudFormation works


def test_create_refuses_a_stack_being_deleted_or_failed():
    for status, message in [
        ("DELETE_IN_PROGRESS", "is being deleted"),
        ("ROLLBACK_COMPLETE", "failed to create"),
        ("UPDATE_IN_PROGRESS", "is busy"),
        ("CREATE_COMPLETE", "already exists"),
    ]:
        stub = StubCfn([status])
        with pytest.raises(JobExists, match=message):
            StackOps(stub, poll=0, progress=lambda _: None).create("petctl", "{}", {}, "petctl base stack")
        assert "create_stack" not in stub.calls


def test_wait_for_deletion_ends_when_the_stack_is_gone():
    assert (
        StackOps(StubCfn([], exists=False), poll=0, progress=lambda _: None).wait("x", "DELETE_COMPLETE")
        == {}
    )


@pytest.mark.parametrize(
    "code,error,message",
    [
        ("Throttling", ProviderError, "AWS is throttling requests"),
        ("RequestLimitExceeded", ProviderError, "AWS is throttling requests"),
        ("ExpiredToken", NotSetUp, "AWS rejected the credentials"),
        ("InvalidClientTokenId", NotSetUp, "AWS rejected the credentials"),
        ("AccessDenied", ProviderError, "AWS denied permission to create stack x"),
        ("LimitExceeded", ProviderError, "failed to create stack x: LimitExceeded: nope"),
    ],
)
def test_aws_errors_become_one_line_messages(code, error, message):
    with pytest.raises(error, match=message) as raised:
        with aws_errors("create stack x"):
            raise ClientError({"Error": {"Code": code, "Message": "nope"}}, "CreateStack")
    assert "\n" not in str(raised.value)


def test_setup_replaces_a_stack_that_failed_to_create():
    class Recreating(StubCfn):
        def delete_stack(self, StackName):  # noqa: N803
            self.calls.append("delete_stack")
            self.exists = False

        def create_stack(self, **kwargs):
            self.calls.append("create_stack")
            self.exists, self.statuses = True, ["CREATE_COMPLETE"]

    stub = Recreating(["ROLLBACK_COMPLETE"])
    lines: list[str] = []
    StackOps(stub, poll=0, progress=lines.append).create_or_update("petctl", Template(body="{}"), {},
                                                                          "petctl base stack")
    assert stub.calls.count("delete_stack") == 1 and stub.calls.count("create_stack") == 1
    assert any("removing the failed earlier attempt" in line for line in lines)
