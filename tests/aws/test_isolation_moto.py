"""Two jobs side by side against the emulator: job `ab`'s own credentials against job `ab-c`'s S3 prefix.

moto can be told to enforce IAM: a POST of 0 to its server's `/moto-api/reset-auth` sets
INITIAL_NO_AUTH_ACTION_COUNT, after which every request's SigV4 signature is checked against the
caller's credentials and authorised against the caller's IAM policies. So the test:

1. runs both jobs through the provider against moto (`run_job`'s real path: code and records uploaded,
   job stacks created by moto's CloudFormation from the rendered templates);
2. takes job `ab`'s role as CloudFormation created it (path, inline policy with every `!Sub` resolved by
   moto) and assumes it. moto's own enforcement cannot read the inline policies its CloudFormation
   stores (a KeyError inside moto), so the role is recreated once with IAM's API (CreateRole,
   PutRolePolicy: what CloudFormation's handler calls), with the same path and the same documents;
3. switches enforcement on, and makes real S3 calls with `ab`'s temporary credentials: GetObject,
   PutObject, DeleteObject on `ab-c`'s prefix (refused: `ab` is a prefix of `ab-c`, which is how a scope
   without its slash leaks) and on its own (its state writable, its code and config not);
4. switches enforcement off again, and checks with the operator's credentials that `ab-c`'s objects are
   exactly as they were.

What moto cannot judge, and where it is judged instead: moto evaluates actions and resources but ignores
conditions (it fills in no `s3:prefix`, nothing of Auto Scaling's), so listing (`s3:prefix`), the
group release conditions and log streams are evaluated by tests/aws/policy_eval.py
(test_isolation.py). Here that evaluator must give, on every call made, the answer moto gave.
"""

from __future__ import annotations

import json

import pytest

from petctl.core.spec import JobSpec
from tests.aws.policy_eval import allowed
from tests.support.aws.account import REGION, boto, submit, write_script
from tests.support.aws.iam import role_documents

JOBS = ("ab", "ab-c")


def assume_copy(moto: str, role: dict, statements: list[dict]) -> dict:
    """Temporary credentials of a role with the same path and policy (see the module docstring, 2)."""
    iam = boto(moto, "iam")
    copy = iam.create_role(RoleName=f"enforced-{role['RoleName']}"[:64], Path=role["Path"],
                           AssumeRolePolicyDocument=json.dumps(role["AssumeRolePolicyDocument"]))["Role"]
    iam.put_role_policy(RoleName=copy["RoleName"], PolicyName="job-scope",
                        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}))
    return boto(moto, "sts").assume_role(RoleArn=copy["Arn"], RoleSessionName="job-ab")["Credentials"]


def s3_as(moto: str, credentials: dict):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", region_name=REGION, endpoint_url=moto,
                        aws_access_key_id=credentials["AccessKeyId"],
                        aws_secret_access_key=credentials["SecretAccessKey"],
                        aws_session_token=credentials["SessionToken"],
                        config=Config(retries={"max_attempts": 1}))


def attempt(s3, bucket: str, op: str, key: str) -> bool:
    """Whether the call went through (False: AccessDenied; anything else fails the test)."""
    from botocore.exceptions import ClientError

    try:
        if op == "get":
            s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        elif op == "put":
            s3.put_object(Bucket=bucket, Key=key, Body=b"written by job ab")
        else:
            s3.delete_object(Bucket=bucket, Key=key)
        return True
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "AccessDenied", exc
        return False


OTHER_KEYS = ["job.json", "agent.json", "code/train.py", "checkpoints/step-5/model.pt", "result.json",
              "status/i-1.json", "events/i-1/1-0.jsonl", "logs/i-1/1-0.log"]
# (operation, key under jobs/ab/, allowed): its state is writable, its code and config are not.
OWN = [("get", "code/train.py", True), ("get", "agent.json", True), ("get", "job.json", True),
       ("put", "checkpoints/step-5/model.pt", True), ("put", "status/i-1.json", True),
       ("put", "events/i-1/1-0.jsonl", True), ("put", "logs/i-1/1-0.log", True), ("put", "result.json", True),
       ("delete", "checkpoints/step-5/model.pt", True),
       ("put", "code/train.py", False), ("put", "agent.json", False), ("put", "job.json", False),
       ("put", "placement.json", False), ("delete", "code/train.py", False), ("delete", "agent.json", False),
       ("delete", "status/i-1.json", False)]
ACTIONS = {"get": "s3:GetObject", "put": "s3:PutObject", "delete": "s3:DeleteObject"}


@pytest.mark.timeout(300)
def test_job_credentials_cannot_read_write_or_delete_another_jobs_prefix(ready, moto, tmp_path, stack_name):
    import requests

    script = write_script(tmp_path / "code")
    for name in JOBS:
        ready.create_job(submit(JobSpec(name=name, min_size=1, max_size=2, size=1, entrypoint=""), script))
    bucket = ready.settings["outputs"]["BucketName"]
    admin = boto(moto, "s3")
    admin.put_object(Bucket=bucket, Key="jobs/ab-c/checkpoints/step-5/model.pt", Body=b"ab-c's weights")
    before = {k: admin.get_object(Bucket=bucket, Key=f"jobs/ab-c/{k}")["Body"].read()
              for k in OTHER_KEYS[:4]}
    role, statements = role_documents(moto, stack_name, "ab")
    assert role["Path"] == f"/petctl/{stack_name}/ab/"
    assert role_documents(moto, stack_name, "ab-c")[0]["Path"] == f"/petctl/{stack_name}/ab-c/"
    s3 = s3_as(moto, assume_copy(moto, role, statements))

    cases = [(op, f"jobs/ab-c/{key}", False) for op in ACTIONS for key in OTHER_KEYS]
    cases += [(op, f"jobs/ab/{key}", want) for op, key, want in OWN]
    results = {}
    assert requests.post(f"{moto}/moto-api/reset-auth", data=b"0", timeout=10).ok  # enforce IAM from now on
    try:
        for op, key, _ in cases:
            results[(op, key)] = attempt(s3, bucket, op, key)
    finally:
        assert requests.post(f"{moto}/moto-api/reset-auth", data=b"inf", timeout=10).ok
    assert {case: got for case, got in results.items()} == {(op, key): want for op, key, want in cases}
    for op, key, _ in cases:  # the evaluator that judges what moto cannot agrees where moto can
        resource = f"arn:aws:s3:::{bucket}/{key}"
        assert allowed(statements, ACTIONS[op], resource) == results[(op, key)], (op, key)
    after = {k: admin.get_object(Bucket=bucket, Key=f"jobs/ab-c/{k}")["Body"].read() for k in before}
    assert after == before  # job ab changed nothing of job ab-c's
