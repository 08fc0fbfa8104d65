"""The tests' moto server takes one request at a time: moto's backends have no locks, and a request that
reads while another writes can fail inside moto with a 500 that no AWS service would answer (CI saw one in
the emulated end-to-end job, as its job stack was deleted while the instance emulator read the group)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.moto_server import serve_moto

pytest.importorskip("moto.server", reason="moto[server] is not installed")


def test_moto_runs_one_request_at_a_time_while_clients_connect_at_once(monkeypatch):
    import boto3
    from moto.autoscaling.models import AutoScalingBackend

    inside, most, lock = [0], [0], threading.Lock()
    original = AutoScalingBackend.describe_auto_scaling_groups

    def slow_describe(self, *args, **kwargs):  # a read that takes long enough for others to overlap it
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        try:
            return original(self, *args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(AutoScalingBackend, "describe_auto_scaling_groups", slow_describe)
    with serve_moto() as url:
        def describe(_: int) -> int:
            client = boto3.client("autoscaling", endpoint_url=url, region_name="us-east-1",
                                  aws_access_key_id="testing", aws_secret_access_key="testing")
            return len(client.describe_auto_scaling_groups()["AutoScalingGroups"])

        # moto's backends live in this process, shared with the tests run before in it: what one client
        # alone reads first is what all of them must read
        alone = describe(0)
        most[0] = 0
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(describe, range(16)))
    assert answers == [alone] * 16  # every client was answered, and well
    assert most[0] == 1  # ... and moto never ran two of them at once (moto's own server ran up to 8)


def test_the_server_stops_and_frees_its_port():
    import socket

    with serve_moto() as url:
        port = int(url.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_the_price_list_api_answers_no_price_and_prints_nothing(capfd):
    """moto has no Price List API and prints into the test's stdout when asked (where an in-process CLI's
    JSON output then breaks): the server answers it as AWS does for an unlisted product."""
    import boto3

    with serve_moto() as url:
        pricing = boto3.client("pricing", region_name="us-east-1", endpoint_url=url,
                               aws_access_key_id="testing", aws_secret_access_key="testing")
        answer = pricing.get_products(ServiceCode="AmazonEC2", MaxResults=1)
    assert answer["PriceList"] == [] and answer["FormatVersion"] == "aws_v1"
    assert "backend" not in capfd.readouterr().out


def test_delete_stack_is_answered_after_the_registered_waits_which_moto_answers_meanwhile():
    """A stack's deletion waits for the emulated machines moto ended (tests/aws/instance_emulator.py):
    only DeleteStack waits, and it waits outside the one-at-a-time lock, so a machine's last requests
    (here the wait's own DescribeStacks) are answered instead of deadlocking."""
    import boto3

    from tests.support.moto_server import STACK_DELETIONS

    with serve_moto() as url:
        cfn = boto3.client("cloudformation", endpoint_url=url, region_name="us-east-1",
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        seen: list[list[str]] = []

        def wait() -> None:  # runs on the server's thread, inside DeleteStack's request
            seen.append([s["StackStatus"] for s in cfn.describe_stacks(StackName=stack_id)["Stacks"]])

        STACK_DELETIONS.register(wait)
        try:
            stack_id = cfn.create_stack(StackName="s1", TemplateBody='{"Resources": {"T": {"Type": '
                                                                    '"AWS::SNS::Topic"}}}')["StackId"]
            cfn.describe_stacks(StackName="s1")
            assert seen == []  # no other CloudFormation call waits
            cfn.delete_stack(StackName="s1")
            assert seen == [["DELETE_COMPLETE"]]  # waited for before DeleteStack answered
        finally:
            STACK_DELETIONS.unregister(wait)
        cfn.create_stack(StackName="s2", TemplateBody='{"Resources": {"T": {"Type": "AWS::SNS::Topic"}}}')
        cfn.delete_stack(StackName="s2")
    assert len(seen) == 1  # unregistered: not asked again
