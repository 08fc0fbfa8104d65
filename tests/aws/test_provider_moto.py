"""The AWS provider's behaviour against moto (a real HTTP server on loopback): stacks, Auto Scaling
groups, instances and S3. Properties moto does not apply (spot, mixed instances, lifecycle hooks, bucket
policy) are asserted on the rendered templates in test_templates.py instead.
"""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path

import pytest

from petctl.core.errors import JobExists, JobNotFound, NotSetUp, ProviderError, ValidationError
from petctl.core.spec import JobSpec
from petctl.io.config import PetctlConfig
from petctl.providers.aws.boot import CONTAINER_AMI_PARAM
from tests.support.aws.account import (
    REGION,
    all_stacks,
    boto,
    publish_dlami,
    push_worker_image,
    submit,
    view,
    worker_image,
    write_script,
)


def spec(name: str = "demo", min_size: int = 1, max_size: int = 4, size: int = 2, **kw) -> JobSpec:
    return JobSpec(name=name, min_size=min_size, max_size=max_size, size=size, entrypoint="", **kw)


def group(moto: str, name: str) -> dict:
    groups = boto(moto, "autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[name])
    return groups["AutoScalingGroups"][0] if groups["AutoScalingGroups"] else {}


def keys(moto: str, bucket: str, prefix: str) -> list[str]:
    listing = boto(moto, "s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def shipped_script(moto: str, bucket: str, job: str = "demo") -> str:
    """The workers' boot script run_job put in the job's prefix (what their user data fetches)."""
    (key,) = [k for k in keys(moto, bucket, f"jobs/{job}/") if k.startswith(f"jobs/{job}/boot-")]
    return boto(moto, "s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode()


def stack_names(moto: str, base: str) -> set[str]:
    """Live stacks of one base stack (other tests' stacks share the emulator)."""
    stacks = all_stacks(moto)
    return {s["StackName"] for s in stacks if s["StackStatus"] != "DELETE_COMPLETE"
            and (s["StackName"] == base or s["StackName"].startswith(base + "-"))}


# --- setup / teardown ------------------------------------------------------------------------------
def test_setup_creates_base_stack_and_records_outputs(ready, moto, tmp_path, stack_name):
    settings = PetctlConfig.load(tmp_path / "home").section("aws")  # what was saved, read back from disk
    assert settings["ready"] is True and settings["region"] == REGION
    outputs = settings["outputs"]
    assert {"VpcId", "SubnetIds", "EtcdSecurityGroupId", "BucketName", "EtcdEndpoint", "LogGroupName",
            "RepositoryUri", "WorkerPolicyArn"} <= set(outputs)
    stack = boto(moto, "cloudformation").describe_stacks(StackName=stack_name)["Stacks"][0]
    assert stack["StackStatus"] == "UPDATE_COMPLETE"  # created from the seed, updated to the full template
    subnets = boto(moto, "ec2").describe_subnets(SubnetIds=outputs["SubnetIds"].split(","))["Subnets"]
    assert len({s["AvailabilityZone"] for s in subnets}) >= 2
    assert {s["VpcId"] for s in subnets} == {outputs["VpcId"]}
    boto(moto, "s3").head_bucket(Bucket=outputs["BucketName"])
    assert outputs["EtcdEndpoint"] == "https://10.42.0.10:2379"  # client certificates
    subnet0 = outputs["SubnetIds"].split(",")[0]
    eni = boto(moto, "ec2").describe_network_interfaces(
        Filters=[{"Name": "subnet-id", "Values": [subnet0]}])["NetworkInterfaces"]
    # the etcd address lives on an interface of its own (moto drops the ENI's resource tags: no tag filter)
    fixed = [e["PrivateIpAddress"] for e in eni if e["Description"] == "petctl etcd fixed address"]
    assert fixed == ["10.42.0.10"]
    assert group(moto, f"{stack_name}-etcd")["DesiredCapacity"] == 1
    assert settings["image"] == "" and settings["worker_ami"] == ""  # the AMI is resolved by each run_job
    assert PetctlConfig.load(tmp_path / "home").provider == "aws"
    assert any("creating petctl base stack" in line for line in ready.lines)


def test_setup_creates_the_bucket_from_a_seed_then_applies_the_full_template_from_it(ready, moto, stack_name):
    """Issue 44.8: the base template goes by TemplateURL from the stack's own bucket, which the stack itself
    creates: a new stack is created from the seed (the bucket alone, inline), etcd's files and the full
    template are uploaded to that bucket, and the stack is updated from the template's URL."""
    import hashlib
    import re

    bucket = ready.settings["outputs"]["BucketName"]
    (key,) = keys(moto, bucket, "templates/")
    assert re.fullmatch(r"templates/base-[0-9a-f]{16}\.yaml", key)
    stored = boto(moto, "s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert key == f"templates/base-{hashlib.sha256(stored.encode()).hexdigest()[:16]}.yaml"
    deployed = boto(moto, "cloudformation").get_template(StackName=stack_name)["TemplateBody"]
    assert deployed == stored and "EtcdGroup" in stored
    lines = ready.lines
    seeded = next(i for i, line in enumerate(lines) if "creating petctl base stack's bucket" in line)
    shipped = next(i for i, line in enumerate(lines) if line.startswith("uploaded etcd"))
    updated = next(i for i, line in enumerate(lines) if line.startswith("updating petctl base stack"))
    assert seeded < shipped < updated  # the etcd hosts find their files when they first boot


def test_a_setup_whose_full_template_failed_keeps_the_seeds_bucket_and_retries_by_url(provider, moto,
                                                                                     stack_name, monkeypatch,
                                                                                     etcd_mirror):
    """A full template that fails leaves the seed's stack (its update rolled back): the next setup finds
    the bucket there, creates no second one, and applies the template again."""
    from petctl.providers.aws.stacks import StackOps

    real = StackOps.create_or_update

    def full_template_fails(self, name, template, tags, what):  # as UPDATE_ROLLBACK_COMPLETE ends it
        if template.url:
            raise ProviderError(f"stack {name} ended UPDATE_ROLLBACK_COMPLETE: Vpc: (the test's failure)")
        return real(self, name, template, tags, what)

    monkeypatch.setattr(StackOps, "create_or_update", full_template_fails)
    with pytest.raises(ProviderError, match="UPDATE_ROLLBACK_COMPLETE"):
        provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name)
    stack = boto(moto, "cloudformation").describe_stacks(StackName=stack_name)["Stacks"][0]
    (bucket,) = [o["OutputValue"] for o in stack["Outputs"] if o["OutputKey"] == "BucketName"]
    assert "EtcdEndpoint" not in {o["OutputKey"] for o in stack["Outputs"]}  # the seed alone
    monkeypatch.setattr(StackOps, "create_or_update", real)
    provider.setup()
    assert provider.settings["outputs"]["BucketName"] == bucket and provider.settings["ready"] is True
    assert sum(1 for line in provider.lines if "creating petctl base stack's bucket" in line) == 1


def test_setup_again_updates_in_place(ready, moto, stack_name):
    ready.setup()  # region, endpoint and stack name remembered from the first call
    assert stack_names(moto, stack_name) == {stack_name}
    # what the user chose is remembered; derived values (today's AMIs, the image) are re-derived each time
    assert set(ready.settings["options"]) == {"region", "endpoint_url", "stack_name", "etcd_binary",
                                              "etcd_sha256", "etcdctl_sha256"}
    assert ready.settings["ready"] is True


def test_setup_keeps_its_az_plan_so_subnets_never_move(ready, moto, stack_name, monkeypatch):
    from petctl.providers.aws import inventory

    first = dict(ready.settings["network"])
    subnets = ready.settings["outputs"]["SubnetIds"]
    assert len(first["azs"]) == 3 and first["vpc_cidr"] == "10.42.0.0/16"
    # AWS now lists the AZs differently (one impaired, a new one): the stack's subnets must not move
    monkeypatch.setattr(inventory, "usable_azs", lambda session: ["us-east-1b", "us-east-1c", "us-east-1z"])
    ready.setup(max_azs="2")
    assert ready.settings["network"] == first and ready.settings["outputs"]["SubnetIds"] == subnets
    assert any("keeping the stack's 3 AZs" in line for line in ready.lines)
    ready.teardown()
    assert ready.settings["network"] == {}  # a new stack plans again


def test_setup_ships_the_etcd_binary_through_the_bucket(provider, moto, stack_name, etcd_mirror):
    """The pinned release (a fake one, served from loopback: tests/aws/test_etcd_release.py has the
    checksum's refusals), its etcd and etcdctl in the bucket, pinned in the boot script the stub pins."""
    provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name)
    bucket = provider.settings["outputs"]["BucketName"]
    digest = etcd_mirror.etcd_sha256  # the binary of the tarball whose hash is pinned
    stored = keys(moto, bucket, "dist/etcd/")
    assert len(stored) == 3  # etcd, etcdctl (it turns etcd's auth on) and the boot script
    (key,) = [k for k in stored if k.endswith("/etcd")]
    assert key.endswith(f"-{digest[:16]}/etcd") and key.startswith("dist/etcd/v3.6.99-")  # store=v3
    head = boto(moto, "s3").head_object(Bucket=bucket, Key=key)
    assert head["Metadata"]["sha256"] == digest
    (boot_key,) = [k for k in stored if k.startswith("dist/etcd/boot-")]
    lt = boto(moto, "ec2").describe_launch_template_versions(LaunchTemplateName=f"{stack_name}-etcd")
    stub = base64.b64decode(lt["LaunchTemplateVersions"][0]["LaunchTemplateData"]["UserData"]).decode()
    assert f'PETCTL_BUCKET="{bucket}"' in stub and f"KEY={boot_key}" in stub
    script = boto(moto, "s3").get_object(Bucket=bucket, Key=boot_key)["Body"].read().decode()
    assert f"ETCD_SHA256={digest}" in script and f"ETCD_KEY={key}" in script
    provider.setup()  # again: the same object, not uploaded twice
    assert sum(1 for line in provider.lines if line.startswith("uploaded etcd")) == 1


def test_setup_with_three_etcd_nodes(provider, moto, stack_name, etcd_mirror):
    """`setup --etcd-nodes 3`: three one-instance groups, all endpoints in the settings the jobs get,
    etcdctl and the members' boot script in the bucket (pinned by each member's user data)."""
    from petctl.core.endpoints import parse_endpoints
    from petctl.providers.aws.etcdbin import BootScript

    provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name, etcd_nodes="3")
    settings = provider.settings
    assert parse_endpoints(settings["etcd_endpoint"]) == [("10.42.0.10", 2379), ("10.42.16.10", 2379),
                                                          ("10.42.32.10", 2379)]
    assert provider.etcd_endpoint() == settings["etcd_endpoint"] and settings["network"]["etcd_nodes"] == 3
    groups = settings["outputs"]["EtcdGroupNames"].split(",")
    assert groups == [f"{stack_name}-etcd", f"{stack_name}-etcd-1", f"{stack_name}-etcd-2"]
    found = boto(moto, "autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=groups)
    assert len(found["AutoScalingGroups"]) == 3
    bucket = settings["outputs"]["BucketName"]
    stored = keys(moto, bucket, "dist/etcd/")
    ctl = etcd_mirror.etcdctl_sha256
    assert [k for k in stored if k.endswith("/etcdctl")] and len(stored) == 3
    (boot_key,) = [k for k in stored if k.startswith("dist/etcd/boot-")]
    text = boto(moto, "s3").get_object(Bucket=bucket, Key=boot_key)["Body"].read().decode()
    assert BootScript(text).key == boot_key and f"CTL_SHA256={ctl}" in text
    lt = boto(moto, "ec2").describe_launch_template_versions(LaunchTemplateName=f"{stack_name}-etcd-2")
    stub = base64.b64decode(lt["LaunchTemplateVersions"][0]["LaunchTemplateData"]["UserData"]).decode()
    assert f"PETCTL_ETCD_MEMBER=2 PETCTL_BUCKET=\"{bucket}\"" in stub and f"KEY={boot_key}" in stub
    with pytest.raises(ValidationError, match="the stack runs 3 etcd node.s.: changing to 1 needs"):
        provider.setup(etcd_nodes="1")
    with pytest.raises(ValidationError, match=r"--etcd-nodes must be 1 or 3 \(got 2\)"):
        provider.setup(etcd_nodes="2")


def test_setup_store_v2_keeps_etcd_35_with_the_v2_api_and_its_jobs_speak_v2(provider, moto, stack_name,
                                                                            etcd_mirror, tmp_path):
    """`setup --option store=v2`: the pinned 3.5 release with `--enable-v2`, recorded with the stack, so
    every job run_job starts (its agents, via job.json and agent.json) and the job's readers use v2.
    A bad value is one line before anything exists; the store holds for the stack's life."""
    with pytest.raises(ValidationError, match="setup option store must be one of v3, v2, not 'v4'") as bad:
        provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name, store="v4")
    assert "\n" not in str(bad.value) and stack_name not in {s["StackName"] for s in all_stacks(moto)}
    assert etcd_mirror.requests == [] and not provider.settings.get("ready")
    provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name, store="v2")
    assert provider.settings["store"] == "v2"
    bucket = provider.settings["outputs"]["BucketName"]
    stored = keys(moto, bucket, "dist/etcd/")
    assert [k for k in stored if k.endswith("/etcd")][0].startswith("dist/etcd/v3.5.99-")
    assert etcd_mirror.requests == ["/v3.5.99/etcd-v3.5.99-linux-amd64.tar.gz"]
    (boot_key,) = [k for k in stored if k.startswith("dist/etcd/boot-")]
    script = boto(moto, "s3").get_object(Bucket=bucket, Key=boot_key)["Body"].read().decode()
    assert "ExecStart=/usr/local/bin/etcd --enable-v2 " in script and "ETCD_VERSION=v3.5.99" in script
    publish_dlami(moto)
    provider.create_job(submit(spec(), write_script(tmp_path / "src")))
    s3 = boto(moto, "s3")
    agent = json.loads(s3.get_object(Bucket=bucket, Key="jobs/demo/agent.json")["Body"].read())
    job = json.loads(s3.get_object(Bucket=bucket, Key="jobs/demo/job.json")["Body"].read())
    assert agent["job"]["etcd_store"] == job["etcd_store"] == "v2"
    provider._etcd_answers[provider.etcd_endpoint()] = True  # as from inside the VPC: no probe here
    assert provider.sources("demo").etcd_store == "v2"
    provider.setup()  # again, no options: the stack's own store
    assert provider.settings["store"] == "v2"
    with pytest.raises(ValidationError, match=r"the stack runs store=v2 \(etcd v3\.5\.99\): changing to v3 "
                                              "needs `petctl teardown` first"):
        provider.setup(store="v3")
    assert provider.settings["store"] == provider.settings["options"]["store"] == "v2"  # v3 not recorded


def test_a_stack_set_up_before_the_store_option_keeps_etcd_35():
    """Its etcd runs 3.5 with v2 auth data, which must leave the data dir before etcd 3.6 runs on it: it
    stays v2 (its jobs with it) until a teardown; a new stack is v3."""
    from petctl.providers.aws.basestack import stack_store

    assert stack_store({"ready": True}, "") == "v2"
    with pytest.raises(ValidationError, match="changing to v3 needs `petctl teardown` first"):
        stack_store({"ready": True}, "v3")
    assert stack_store({"ready": False, "store": "v2"}, "") == "v3"  # torn down: a new stack
    assert stack_store({}, "v2") == "v2" and stack_store({}, "") == "v3"


def test_setup_with_private_subnets(provider, moto, stack_name, tmp_path):
    """`setup --option subnets=private` (issue 17.8): no public addresses, no internet gateway, and an
    interface endpoint for every AWS API the instances call; the choice holds for the stack's life."""
    from petctl.providers.aws.network import INTERFACE_ENDPOINTS
    from tests.support.aws.etcd_release import fake_etcd_options

    with pytest.raises(ValidationError, match="subnets must be public or private .got 'hidden'"):
        provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name, subnets="hidden")
    provider.setup(region=REGION, endpoint_url=moto, stack_name=stack_name, subnets="private",
                   **fake_etcd_options(tmp_path))
    outputs = provider.settings["outputs"]
    ec2 = boto(moto, "ec2")
    subnets = ec2.describe_subnets(SubnetIds=outputs["SubnetIds"].split(","))["Subnets"]
    assert subnets and not any(s["MapPublicIpOnLaunch"] for s in subnets)
    vpc = [{"Name": "vpc-id", "Values": [outputs["VpcId"]]}]
    assert ec2.describe_internet_gateways(Filters=[{"Name": "attachment.vpc-id",
                                                    "Values": [outputs["VpcId"]]}])["InternetGateways"] == []
    endpoints = ec2.describe_vpc_endpoints(Filters=vpc)["VpcEndpoints"]
    interface = {e["ServiceName"].split(f"{REGION}.", 1)[1] for e in endpoints
                 if e["VpcEndpointType"] == "Interface"}
    assert interface == set(INTERFACE_ENDPOINTS)
    assert provider.settings["network"]["subnets"] == "private"
    with pytest.raises(ValidationError, match="the stack has private subnets: changing to public needs"):
        provider.setup(subnets="public")


def test_setup_rejects_unknown_options(provider, moto):
    with pytest.raises(ValidationError, match="unknown aws setup option"):
        provider.setup(region=REGION, endpoint_url=moto, colour="blue")


def test_teardown_refuses_while_jobs_exist_then_force_removes_everything(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    with pytest.raises(JobExists, match="still exist.*demo"):
        ready.teardown()
    assert stack_names(moto, stack_name) == {stack_name, f"{stack_name}-job-demo"}
    ready.teardown(force=True)
    assert stack_names(moto, stack_name) == set()
    assert ready.settings["ready"] is False
    with pytest.raises(NotSetUp):
        ready.jobs()


def test_setup_will_not_update_the_base_under_a_job_of_the_old_iam_layout(ready, moto, tmp_path, stack_name):
    """A job stack from before per-job IAM paths (no `petctl:layout` tag) has its role at `/`, which the
    updated base's service role may not delete: setup refuses, changes nothing, and names the job; once it
    is killed (by the old service role, still in place), setup goes on. A current job does not block it."""
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    ready.setup()  # a job of this petctl's layout: the update goes ahead
    cfn = boto(moto, "cloudformation")
    job_stack = f"{stack_name}-job-demo"
    tags = cfn.describe_stacks(StackName=job_stack)["Stacks"][0]["Tags"]
    assert {"Key": "petctl:layout", "Value": "job-iam-boundary"} in tags
    cfn.update_stack(StackName=job_stack, UsePreviousTemplate=True,  # what an earlier petctl tagged
                     Tags=[t for t in tags if t["Key"] != "petctl:layout"],
                     Capabilities=["CAPABILITY_IAM", "CAPABILITY_NAMED_IAM"])
    before = cfn.describe_stacks(StackName=stack_name)["Stacks"][0].get("LastUpdatedTime")
    with pytest.raises(JobExists, match=r"earlier petctl \(demo\).*kill_job"):
        ready.setup()
    assert cfn.describe_stacks(StackName=stack_name)["Stacks"][0].get("LastUpdatedTime") == before
    ready.kill_job("demo")
    ready.setup()
    assert stack_names(moto, stack_name) == {stack_name}


def test_teardown_without_jobs(ready, moto, stack_name):
    bucket = ready.settings["outputs"]["BucketName"]
    ready.teardown()
    assert stack_names(moto, stack_name) == set()
    boto(moto, "s3").head_bucket(Bucket=bucket)  # kept on purpose: it holds checkpoints
    assert any(f"kept bucket s3://{bucket}" in line for line in ready.lines)


# --- jobs ------------------------------------------------------------------------------------------
def test_run_job_creates_stack_and_group_with_sizes_and_tags(ready, moto, tmp_path, stack_name):
    script = write_script(tmp_path / "src")
    info = ready.create_job(submit(spec(size=3, instance_types=["g5.xlarge"]), script))
    assert (info.name, info.state, info.min_size, info.max_size, info.desired) == ("demo", "running", 1, 4, 3)
    g = group(moto, f"{stack_name}-job-demo")
    assert (g["MinSize"], g["MaxSize"], g["DesiredCapacity"]) == (1, 4, 3)
    tags = {t["Key"]: t["Value"] for t in g["Tags"]}
    assert tags["petctl:job"] == "demo" and tags["petctl:stack"] == stack_name
    assert len([i for i in g["Instances"] if i["LifecycleState"] == "InService"]) == 3
    assert g["VPCZoneIdentifier"] == ready.settings["outputs"]["SubnetIds"].split(",")[0]  # one AZ per job
    assert "instances launched: 3/3" in ready.lines  # launched; joining is `run_job --wait`'s
    hosts = ready.hosts("demo")
    assert len(hosts) == 3 and {h.state for h in hosts} == {"running"}
    assert {h.instance_type for h in hosts} == {"g5.xlarge"}


def test_run_job_uploads_code_and_job_records(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(args=["--lr", "0.1"]), write_script(tmp_path / "src")))
    bucket = ready.settings["outputs"]["BucketName"]
    listed = keys(moto, bucket, "jobs/demo/")
    shipped = [k for k in listed if k.startswith(("jobs/demo/boot-", "jobs/demo/template-"))]
    assert len(shipped) == 2  # the workers' boot script and the stack's template (issue 44.8)
    listed = [k for k in listed if k not in shipped]
    assert listed[:4] == ["jobs/demo/agent.json", "jobs/demo/code/train.py", "jobs/demo/job.json",
                          "jobs/demo/placement.json"]
    (wheel,) = listed[4:]  # what the instances install (the default boot)
    assert wheel.startswith("jobs/demo/wheelhouse/petctl-0.1.0+") and wheel.endswith("-py3-none-any.whl")
    agent = json.loads(boto(moto, "s3").get_object(Bucket=bucket, Key="jobs/demo/agent.json")["Body"].read())
    job = agent["job"]
    assert job["code_url"] == f"s3://{bucket}/jobs/demo/code/train.py" and job["entrypoint"] == "train.py"
    assert job["checkpoint_url"] == f"s3://{bucket}/jobs/demo/checkpoints"
    assert job["etcd_endpoint"] == "https://10.42.0.10:2379" and job["args"] == ["--lr", "0.1"]
    assert job["etcd_store"] == ready.settings["store"] == "v3"  # the stack's etcd 3.6 serves v3 only
    assert agent["status_url"] == f"s3://{bucket}/jobs/demo/"
    assert (agent["asg_name"], agent["lifecycle_hook"], agent["region"]) == (f"{stack_name}-job-demo",
                                                                             "petctl-drain", REGION)
    assert agent["imds_endpoint"] == "http://169.254.169.254"


def test_instances_fetch_the_boot_script_with_the_job_config_from_the_jobs_prefix(ready, moto, tmp_path,
                                                                                   stack_name):
    """Issue 44.8: the user data is a stub pinning the checksum of the boot script run_job put in the
    job's prefix; the script holds the job's config. The job's stack was created by TemplateURL from the
    same prefix."""
    import hashlib
    import re

    from petctl.providers.aws.boot import MAX_USER_DATA, USER_DATA_ROOM, agent_config_from_script

    ready.create_job(submit(spec(args=["--lr", "0.1"]), write_script(tmp_path / "src")))
    instance = ready.hosts("demo")[0].host_id
    data = boto(moto, "ec2").describe_instance_attribute(InstanceId=instance, Attribute="userData")
    stub = base64.b64decode(data["UserData"]["Value"]).decode()
    assert len(stub.encode()) <= MAX_USER_DATA - USER_DATA_ROOM and "PETCTL_AGENT_CONFIG" not in stub
    bucket = ready.settings["outputs"]["BucketName"]
    key = re.search(r"^KEY=(\S+)$", stub, re.M).group(1)
    digest = re.search(r"^SHA256=(\S+)$", stub, re.M).group(1)
    assert f"BUCKET={bucket}\n" in stub and key.startswith("jobs/demo/boot-")
    script = boto(moto, "s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    assert hashlib.sha256(script).hexdigest() == digest
    config = agent_config_from_script(script.decode())
    assert config.job.name == "demo" and config.asg_name == f"{stack_name}-job-demo"
    assert config.job.args == ["--lr", "0.1"]
    (template_key,) = [k for k in keys(moto, bucket, "jobs/demo/") if "/template-" in k]
    stored = boto(moto, "s3").get_object(Bucket=bucket, Key=template_key)["Body"].read().decode()
    deployed = boto(moto, "cloudformation").get_template(StackName=f"{stack_name}-job-demo")["TemplateBody"]
    assert deployed == stored


def test_run_job_uploads_a_directory_as_an_archive(ready, moto, tmp_path):
    src = tmp_path / "proj"
    write_script(src, "main.py")
    write_script(src / "pkg", "util.py", "X = 1\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "junk.pyc").write_bytes(b"x")
    ready.create_job(submit(_dir_spec(), src))
    bucket = ready.settings["outputs"]["BucketName"]
    body = boto(moto, "s3").get_object(Bucket=bucket, Key="jobs/demo/code/code.tar.gz")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert sorted(tar.getnames()) == ["main.py", "pkg/util.py"]


def _dir_spec() -> JobSpec:
    s = spec()
    s.entrypoint = "main.py"
    return s


def test_validation_happens_before_any_aws_call(ready, moto, tmp_path, stack_name, monkeypatch):
    script = write_script(tmp_path / "src")
    bucket = ready.settings["outputs"]["BucketName"]
    cases = [
        (spec(min_size=3, max_size=2, size=2), "--min"),
        (spec(size=5), "--size 5 is outside"),
        (spec(instance_types=["g5-xlarge"]), "invalid instance type"),
        (spec(instance_types=["zz9.large"]), "unknown instance family"),
        (spec(instance_types=["g5.xlarge", "c5.large"]), "mixes GPU and CPU"),
        (spec(on_demand_base=9), "--on-demand-base 9"),
        (spec(), "script not found", tmp_path / "missing.py"),
        (spec(), "--entrypoint", tmp_path / "src"),
    ]

    def no_aws(*args, **kwargs):
        raise AssertionError("an AWS session was opened before the input was validated")

    with monkeypatch.context() as patched:
        patched.setattr(ready, "session", no_aws)
        for bad, message, *path in cases:
            with pytest.raises(ValidationError, match=message):
                ready.create_job(submit(bad, path[0] if path else script))
    assert keys(moto, bucket, "jobs/") == [] and stack_names(moto, stack_name) == {stack_name}


def test_run_job_refuses_when_the_worker_image_was_never_pushed(ready, moto, tmp_path, stack_name):
    image = worker_image(ready)
    with pytest.raises(ValidationError, match="worker image .*:0.1.0 is not in ECR"):
        ready.create_job(submit(spec(), write_script(tmp_path / "src"), image=image))
    with pytest.raises(ValidationError, match="must be in this region's ECR"):  # cannot check its platform
        ready.create_job(submit(spec(), write_script(tmp_path / "src"), image="ghcr.io/example/w:1"))
    push_worker_image(moto, image + "-arm", architecture="arm64")  # `docker build` on Apple silicon
    with pytest.raises(ValidationError, match=r"built for linux/arm64, not linux/amd64 .*--platform"):
        ready.create_job(submit(spec(), write_script(tmp_path / "src"), image=image + "-arm"))
    assert stack_names(moto, stack_name) == {stack_name}
    assert keys(moto, ready.settings["outputs"]["BucketName"], "jobs/") == []  # refused before any upload
    push_worker_image(moto, image)
    ready.create_job(submit(spec(), write_script(tmp_path / "src"), image=image))
    template = boto(moto, "cloudformation").get_template(StackName=f"{stack_name}-job-demo")["TemplateBody"]
    script = shipped_script(moto, ready.settings["outputs"]["BucketName"])
    assert "docker run" in script and image in script  # today's container path
    ecs_ami = boto(moto, "ssm").get_parameter(Name=CONTAINER_AMI_PARAM)["Parameter"]["Value"]
    assert ecs_ami in template  # on the ECS GPU AMI (Docker and the NVIDIA container toolkit)


def test_run_job_boots_the_deep_learning_ami_with_this_petctls_wheel(ready, moto, tmp_path, stack_name):
    dlami = publish_dlami(moto)
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    template = boto(moto, "cloudformation").get_template(StackName=f"{stack_name}-job-demo")["TemplateBody"]
    bucket = ready.settings["outputs"]["BucketName"]
    script = shipped_script(moto, bucket)
    assert dlami in template and "docker pull" not in script and "docker run" not in script
    (wheel,) = [k for k in keys(moto, bucket, "jobs/demo/wheelhouse/")]
    assert f"s3://{bucket}/{wheel}" in script and "/opt/pytorch/bin/python -m petctl.agent.main" in script
    assert any("torch 2.13, CUDA 13.0" in line for line in ready.lines), ready.lines


def test_run_job_refuses_a_dlami_whose_torch_is_outside_the_supported_range(ready, moto, tmp_path,
                                                                           stack_name):
    publish_dlami(moto, name="Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.4 (Amazon Linux 2023) 2024")
    with pytest.raises(ProviderError, match=r"torch 2.4, .* outside petctl's supported range >=2.5,<3"):
        ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    assert stack_names(moto, stack_name) == {stack_name}
    publish_dlami(moto)  # what the next test's `ready` expects


def test_run_job_refuses_an_ami_petctl_cannot_boot_before_creating_anything(ready, moto, tmp_path,
                                                                            stack_name):
    """Issue 44.6: what DescribeImages says of the AMI is checked before anything is uploaded or created."""
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    dlami = publish_dlami(moto)
    ec2_backends[DEFAULT_ACCOUNT_ID][REGION].amis[dlami].root_device_type = "instance-store"
    with pytest.raises(ProviderError, match=f"AMI {dlami}: its root device is instance-store"):
        ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    assert stack_names(moto, stack_name) == {stack_name}
    assert keys(moto, ready.settings["outputs"]["BucketName"], "jobs/demo/") == []
    publish_dlami(moto)  # what the next test's `ready` expects


def test_run_job_refuses_private_subnets_on_the_default_path(ready, moto, tmp_path, stack_name):
    ready.settings["network"]["subnets"] = "private"
    with pytest.raises(ValidationError, match="private subnets cannot reach the package index.*--image"):
        ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    with pytest.raises(ValidationError, match="--requirements is for the default"):
        requirements = tmp_path / "req.txt"
        requirements.write_text("einops\n")
        ready.create_job(submit(spec(), write_script(tmp_path / "src"), image=worker_image(ready),
                                requirements=requirements))
    assert stack_names(moto, stack_name) == {stack_name}


def test_existing_job_is_refused_without_touching_it(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    with pytest.raises(JobExists, match="already exists"):
        ready.create_job(submit(spec(size=1), write_script(tmp_path / "src")))
    assert group(moto, f"{stack_name}-job-demo")["DesiredCapacity"] == 2


def test_scale_changes_desired_capacity_within_bounds(ready, moto, tmp_path, stack_name):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    ready.scale("demo", 4)
    assert group(moto, f"{stack_name}-job-demo")["DesiredCapacity"] == 4
    assert ready.job("demo").desired == 4
    with pytest.raises(ValidationError, match="outside the job's"):
        ready.scale("demo", 5)
    with pytest.raises(JobNotFound):
        ready.scale("nope", 1)
    assert group(moto, f"{stack_name}-job-demo")["DesiredCapacity"] == 4


def test_terminated_instance_is_seen_by_hosts(ready, moto, tmp_path):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    victim = ready.terminate_host("demo", None)
    states = {h.host_id: h.state for h in ready.hosts("demo")}
    assert states[victim] == "terminated"
    with pytest.raises(ProviderError, match="not supported on aws"):
        ready.terminate_host("demo", None, mode="freeze")
    with pytest.raises(ProviderError, match="no instance"):
        ready.terminate_host("demo", "i-00000000000000000")


def test_kill_job_removes_that_job_and_nothing_else(ready, moto, tmp_path, stack_name):
    script = write_script(tmp_path / "src")
    ready.create_job(submit(spec("one"), script))
    ready.create_job(submit(spec("two"), script))
    assert sorted(j.name for j in ready.jobs()) == ["one", "two"]
    ready.kill_job("one")
    assert stack_names(moto, stack_name) == {stack_name, f"{stack_name}-job-two"}
    assert group(moto, f"{stack_name}-job-one") == {}
    assert group(moto, f"{stack_name}-job-two")["DesiredCapacity"] == 2
    # The killed job stays on record (from its S3 prefix), the other keeps running.
    assert {j.name: j.state for j in ready.jobs()} == {"one": "killed", "two": "running"}
    bucket = ready.settings["outputs"]["BucketName"]
    assert "jobs/one/job.json" in keys(moto, bucket, "jobs/one/")  # its checkpoints/code stay
    assert ready.job("one").state == "killed" and ready.job("one").extra["stack"] is None
    ready.kill_job("one")  # an ended job whose stack is gone: nothing to remove, and no error
    assert ready.job("one").state == "killed"
    with pytest.raises(JobNotFound):
        ready.job("never-ran")


def test_status_and_logs_from_the_s3_mirror(ready, moto, tmp_path):
    ready.create_job(submit(spec(), write_script(tmp_path / "src")))
    bucket = ready.settings["outputs"]["BucketName"]
    s3 = boto(moto, "s3")
    for i, node in enumerate(["i-aaa", "i-bbb"]):
        state = {"node_id": node, "state": "running", "round": 2, "rank": i, "world_size": 2, "step": 7,
                 "updated": 1.0, "failures": {"etcd": i}}
        s3.put_object(Bucket=bucket, Key=f"jobs/demo/status/{node}.json", Body=json.dumps(state).encode())
        log = f"hello from {node}\nstep 7\n".encode()
        s3.put_object(Bucket=bucket, Key=f"jobs/demo/logs/{node}.log", Body=log)
    events = [{"ts": 2.0, "event": "round.frozen", "node": "i-aaa"}, {"ts": 1.0, "event": "agent.started"}]
    s3.put_object(Bucket=bucket, Key="jobs/demo/events/i-aaa.jsonl",
                  Body="".join(json.dumps(e) + "\n" for e in events).encode() + b"not json\n")
    s3.put_object(Bucket=bucket, Key="jobs/demo/status/i-ccc.json", Body=b'{"node_id": "i-ccc"')  # torn
    # read through the provider's own session (its endpoint here), sorted by time
    demo = view(ready, "demo")
    assert [e["event"] for e in demo.events()] == ["agent.started", "round.frozen"]
    state = demo.state()  # etcd (10.42.0.10) is unreachable from here: the mirror answers
    assert state.source == "mirror" and state.ranks == {"i-aaa": 0, "i-bbb": 1} and state.state == "running"
    assert {n: s.failures for n, s in state.nodes.items()} == {"i-aaa": {"etcd": 0}, "i-bbb": {"etcd": 1}}
    assert demo.corrupt.to_dict() == {"event": 1, "node status": 1}  # skipped and counted, never fatal
    assert list(demo.logs(node="i-bbb")) == ["hello from i-bbb", "step 7"]
    assert list(demo.logs()) == ["[i-aaa] hello from i-aaa", "[i-aaa] step 7",
                                 "[i-bbb] hello from i-bbb", "[i-bbb] step 7"]
    with pytest.raises(ProviderError, match="no log for node"):
        list(demo.logs(node="i-zzz"))
    for node in ("i-aaa", "i-bbb"):  # a node's "succeeded" is its own workers', not the job's end
        s3.put_object(Bucket=bucket, Key=f"jobs/demo/status/{node}.json",
                      Body=json.dumps({"node_id": node, "state": "succeeded", "updated": 2.0}).encode())
    assert ready.job("demo").state == "running"
    result = {"job": "demo", "state": "succeeded", "reason": "all workers exited 0", "node": "i-aaa",
              "ts": 3.0}
    s3.put_object(Bucket=bucket, Key="jobs/demo/result.json", Body=json.dumps(result).encode())
    assert ready.job("demo").state == "succeeded" and view(ready, "demo").state().state == "succeeded"
    ready.kill_job("demo")
    assert ready.job("demo").state == "succeeded"  # its own result is what stays on record
    assert list(view(ready, "demo").logs(node="i-aaa")) == ["hello from i-aaa", "step 7"]  # outlive the job
    with pytest.raises(JobNotFound):
        list(view(ready, "never-ran").logs())


# --- errors the user can act on --------------------------------------------------------------------
def test_missing_credentials(provider, moto, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(NotSetUp, match="no AWS credentials found"):
        provider.setup(region=REGION, endpoint_url=moto)


def test_unknown_region(provider, moto):
    with pytest.raises(ValidationError, match="unknown AWS region 'us-esat-1'"):
        provider.setup(region="us-esat-1", endpoint_url=moto)


def test_unknown_profile(provider, moto):
    with pytest.raises(NotSetUp, match="profile 'nobody' not found"):
        provider.setup(region=REGION, profile="nobody", endpoint_url=moto)


def test_commands_before_setup(provider):
    with pytest.raises(NotSetUp, match="not set up"):
        provider.create_job(submit(spec(), Path("x.py")))
    with pytest.raises(NotSetUp):
        provider.jobs()
