"""Each job's network and etcd credentials on AWS, against moto: what setup, run_job, kill_job and
teardown create and delete (petctl/providers/aws/etcdsecrets.py, cfn/job.yaml.j2).

- setup makes etcd's certificates once: the operator's secret (both CAs) and the etcd hosts' secret (a
  PEM bundle with a server certificate for the members' fixed addresses), before the stack;
- each run_job makes one secret for that run's etcd user, which the job's role (and only it) may read,
  and which its agents are pointed at; its own security group admitted to etcd by a rule of its own;
- kill_job deletes that job's secret and its rule (with its stack), leaving the other job's alone;
- teardown deletes every etcd secret of the installation.
"""

from __future__ import annotations

import ast
import base64
import ipaddress
import json
from urllib.parse import unquote

import pytest
from cryptography import x509

from petctl.core.spec import JobSpec
from petctl.io.etcdauth import USER_RE
from petctl.io.etcdpki import EtcdPki, common_name
from petctl.providers.aws import etcdsecrets
from tests.support.aws.account import boto, submit, write_script


def spec(name: str) -> JobSpec:
    return JobSpec(name=name, min_size=1, max_size=2, size=1, entrypoint="")


def secret_names(moto: str, prefix: str) -> list[str]:
    return etcdsecrets.list_names(boto(moto, "secretsmanager"), prefix)


def etcd_group_sources(moto: str, group_id: str) -> set[str]:
    (group,) = boto(moto, "ec2").describe_security_groups(GroupIds=[group_id])["SecurityGroups"]
    return {pair["GroupId"] for rule in group["IpPermissions"] for pair in rule.get("UserIdGroupPairs", [])
            if rule.get("FromPort") == 2379}


def role_policy(iam, role: str) -> dict:
    doc = iam.get_role_policy(RoleName=role, PolicyName="job-scope")["PolicyDocument"]
    if isinstance(doc, dict):
        return doc
    try:
        return json.loads(unquote(doc))  # IAM returns it URL-encoded
    except ValueError:
        return ast.literal_eval(doc)  # moto, for a role its CloudFormation made: Python's repr


def instance_user_data(moto: str, provider, job: str) -> str:
    """The boot script one of the job's instances runs, as EC2 holds it."""
    instance = provider.hosts(job)[0].host_id
    data = boto(moto, "ec2").describe_instance_attribute(InstanceId=instance, Attribute="userData")
    return base64.b64decode(data["UserData"]["Value"]).decode()


def bucket_keys(s3, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def job_group(moto: str, stack: str) -> str:
    outputs = boto(moto, "cloudformation").describe_stacks(StackName=stack)["Stacks"][0]["Outputs"]
    return {o["OutputKey"]: o["OutputValue"] for o in outputs}["JobSecurityGroupId"]


def test_setup_makes_etcds_certificates_once(ready, moto, stack_name):
    sm = boto(moto, "secretsmanager")
    assert secret_names(moto, f"{stack_name}/etcd/") == [f"{stack_name}/etcd/host",
                                                         f"{stack_name}/etcd/operator"]
    pki = EtcdPki.from_json(sm.get_secret_value(SecretId=f"{stack_name}/etcd/operator")["SecretString"])
    bundle = sm.get_secret_value(SecretId=f"{stack_name}/etcd/host")["SecretString"]
    parts = dict(zip(etcdsecrets.HOST_PARTS, bundle.split("# petctl-etcd ")[1:], strict=True))
    assert all(text.startswith(name + "\n") for name, text in parts.items())
    assert pki.jobs_ca.key not in bundle and pki.admin_ca.key not in bundle  # no CA key on the hosts
    server = x509.load_pem_x509_certificate(parts["server"].split("\n", 1)[1].encode())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.42.0.10") in sans.get_values_for_type(x509.IPAddress)
    ready.setup()  # again: the same CA (the running etcd and every job's certificate depend on it)
    again = sm.get_secret_value(SecretId=f"{stack_name}/etcd/operator")["SecretString"]
    assert EtcdPki.from_json(again) == pki


def test_each_job_gets_its_own_credentials_group_and_etcd_rule_and_kill_job_removes_them(
        ready, moto, tmp_path, stack_name):
    script = write_script(tmp_path / "src")
    sm, iam, s3 = boto(moto, "secretsmanager"), boto(moto, "iam"), boto(moto, "s3")
    bucket = ready.settings["outputs"]["BucketName"]
    etcd_sg = ready.settings["outputs"]["EtcdSecurityGroupId"]
    arns, groups = {}, {}
    for job in ("one", "two"):
        ready.create_job(submit(spec(job), script))
        (name,) = secret_names(moto, f"{stack_name}/etcd/jobs/{job}/")
        described = sm.describe_secret(SecretId=name)
        arns[job] = described["ARN"]
        user = {t["Key"]: t["Value"] for t in described["Tags"]}["petctl:etcd-user"]
        assert USER_RE.match(user) and user.startswith(f"job-{job}-")
        # the etcd hosts learn the user from the bucket's index, never by listing secrets (issue 24.2)
        assert bucket_keys(s3, bucket, f"etcd-users/{job}/") == [f"etcd-users/{job}/{user}"]
        doc = json.loads(sm.get_secret_value(SecretId=name)["SecretString"])
        assert common_name(doc["cert"]) == user and "PRIVATE KEY" in doc["key"]
        agent = json.loads(s3.get_object(Bucket=bucket, Key=f"jobs/{job}/agent.json")["Body"].read())
        assert agent["job"]["etcd_credentials"] == arns[job]  # a reference, never the key itself
        assert agent["job"]["etcd_endpoint"].startswith("https://")
        # Only the secret holds the run's key: not the instances' user data, the job's template, nor
        # anything the run wrote to the bucket (records, code: what the job's logs and status show).
        exposed = {"user data": instance_user_data(moto, ready, job),
                   "template": json.dumps(boto(moto, "cloudformation").get_template(
                       StackName=f"{stack_name}-job-{job}")["TemplateBody"]),
                   **{key: s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode(errors="replace")
                      for key in bucket_keys(s3, bucket, f"jobs/{job}/")}}
        (boot_text,) = [text for where, text in exposed.items() if where.startswith(f"jobs/{job}/boot-")]
        assert len(exposed) > 3 and arns[job] in boot_text  # the boot script its user data fetches
        key_body = doc["key"].split("-----")[2].strip()[:64]
        assert not [where for where, text in exposed.items() if key_body in text or "PRIVATE KEY" in text]
        groups[job] = job_group(moto, f"{stack_name}-job-{job}")
    assert groups["one"] != groups["two"]
    assert {groups["one"], groups["two"]} <= etcd_group_sources(moto, etcd_sg)
    for job, other in (("one", "two"), ("two", "one")):
        role = f"{stack_name}-job-{job}"
        roles = [r["RoleName"] for r in iam.list_roles()["Roles"] if r["RoleName"].startswith(role)]
        (policy,) = [role_policy(iam, r) for r in roles]
        secrets = [(s["Action"], s["Resource"]) for s in policy["Statement"]
                   if "secretsmanager" in json.dumps(s["Action"])]
        assert secrets == [("secretsmanager:GetSecretValue", arns[job])]
        assert arns[other] not in json.dumps(policy)

    ready.kill_job("one")
    assert secret_names(moto, f"{stack_name}/etcd/jobs/one/") == []
    assert bucket_keys(s3, bucket, "etcd-users/one/") == []
    assert len(bucket_keys(s3, bucket, "etcd-users/")) == 1
    assert len(secret_names(moto, f"{stack_name}/etcd/jobs/two/")) == 1
    sources = etcd_group_sources(moto, etcd_sg)
    assert groups["two"] in sources and groups["one"] not in sources

    ready.teardown(force=True)
    assert secret_names(moto, f"{stack_name}/etcd/") == []
    assert bucket_keys(s3, bucket, "etcd-users/") == []


def test_a_job_whose_stack_fails_leaves_no_credentials(ready, moto, tmp_path, stack_name, monkeypatch):
    from petctl.core.errors import ProviderError
    from petctl.providers.aws.stacks import StackOps

    def fail(*args, **kwargs):
        raise ProviderError("stack creation failed (injected)")

    monkeypatch.setattr(StackOps, "create", fail)
    try:
        ready.create_job(submit(spec("broken"), write_script(tmp_path / "src")))
    except ProviderError:
        pass
    else:
        raise AssertionError("create_job should have failed")
    assert secret_names(moto, f"{stack_name}/etcd/jobs/") == []
    assert bucket_keys(boto(moto, "s3"), ready.settings["outputs"]["BucketName"], "etcd-users/") == []


@pytest.mark.timeout(300)
def test_two_jobs_side_by_side_job_a_cannot_reach_job_bs_rendezvous(ready, moto, tmp_path, stack_name):
    """`ab` and `ab-c` (one name a prefix of the other) through run_job against moto. Job ab's role, as
    moto's CloudFormation created it, may read its own run's certificate and not ab-c's, nor the
    installation's secrets (judged with IAM's logic by tests/aws/policy_eval.py: moto authorises Secrets
    Manager calls against "*" only, so it cannot judge a scoped grant). With the one certificate it can
    read, on a real etcd run as the etcd host runs it (the installation's certificates from moto, auth on,
    a user per job secret: tests/aws/instance_emulator.py), job ab reaches its own rendezvous keys and
    none of ab-c's."""
    from petctl.core.keys import JobKeys
    from petctl.core.store import StoreDenied
    from petctl.io.etcdpki import write_credentials
    from petctl.io.store import open_store
    from tests.aws.instance_emulator import InstanceEmulator
    from tests.aws.policy_eval import allowed
    from tests.support.aws.account import REGION
    from tests.support.aws.iam import role_documents

    script = write_script(tmp_path / "src")
    for job in ("ab", "ab-c"):
        ready.create_job(submit(spec(job), script))
    sm = boto(moto, "secretsmanager")
    arns = {job: sm.describe_secret(SecretId=name)["ARN"]
            for job in ("ab", "ab-c") for name in secret_names(moto, f"{stack_name}/etcd/jobs/{job}/")}
    installation = [sm.describe_secret(SecretId=f"{stack_name}/etcd/{name}")["ARN"]
                    for name in ("operator", "host")]
    _, statements = role_documents(moto, stack_name, "ab")
    assert allowed(statements, "secretsmanager:GetSecretValue", arns["ab"])
    for arn in (arns["ab-c"], *installation):
        assert not allowed(statements, "secretsmanager:GetSecretValue", arn), arn
    for action in ("ListSecrets", "CreateSecret", "PutSecretValue", "UpdateSecret", "TagResource",
                   "DeleteSecret", "BatchGetSecretValue"):
        assert not any(allowed(statements, f"secretsmanager:{action}", r) for r in ("*", *arns.values()))

    emulator = InstanceEmulator(moto_url=moto, region=REGION, root=tmp_path / "instances")
    try:
        emulator.boot_etcd_host(ready.settings["outputs"]["EtcdGroupName"])
        emulator.sync_etcd_users()
        assert emulator.etcd is not None
        # Through the store the jobs use: the stack's (store=v3 by default: etcd 3.6 serves nothing else).
        backend = ready.settings["store"]
        assert backend == "v3"
        root = open_store(emulator.etcd.endpoint, backend, emulator.etcd_admin)
        root.put(JobKeys("ab-c").round, "ab-c's round")
        doc = json.loads(sm.get_secret_value(SecretId=arns["ab"])["SecretString"])  # what ab's role reads
        ab = open_store(emulator.etcd.endpoint, backend, write_credentials(tmp_path / "ab", **doc))
        ab.put(JobKeys("ab").round, "ab's round")  # its own rendezvous works
        b = JobKeys("ab-c")
        attacks = {"read": lambda: ab.get(b.round), "list": lambda: ab.list(b.base),
                   "write": lambda: ab.put(b.round, "hijacked"), "delete": lambda: ab.delete(b.round),
                   "delete all": lambda: ab.delete_dir(b.base), "wipe": lambda: ab.delete_dir("/")}
        succeeded = []
        for name, attack in attacks.items():
            try:
                attack()
                succeeded.append(name)
            except StoreDenied:
                pass
        assert succeeded == []
        entry = root.get(b.round)
        assert entry is not None and entry.value == "ab-c's round"
        for store in (root, ab):
            store.close()
    finally:
        emulator.stop()
