"""Properties of the rendered CloudFormation templates that moto stores but does not apply (spot market
options, mixed-instances distribution, lifecycle hooks, IMDSv2, security group rules, bucket policy, IAM
scope), plus cfn-lint (errors fail the test) and checkov (when installed) on exactly that output.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.aws import rendered
from tests.aws.rendered import BUCKET, OUTPUTS, parse, resources


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return rendered.write_all(tmp_path_factory.mktemp("cfn"))


@pytest.fixture(scope="module")
def base(templates) -> dict:
    return parse(templates["base"].read_text())


def job(templates, variant: str) -> dict:
    return parse(templates[variant].read_text())


def one(template: dict, kind: str) -> dict:
    found = list(resources(template, kind).values())
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]["Properties"]


def walk(value):
    """Every dict and list inside a template, for 'nowhere in the template' checks."""
    yield value
    if isinstance(value, dict):
        for v in value.values():
            yield from walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from walk(v)


def all_templates(templates) -> list[dict]:
    return [parse(p.read_text()) for p in templates.values()]


# --- job stack ----------------------------------------------------------------------------------------
def test_single_type_spot_uses_launch_template_market_options(templates):
    t = job(templates, "spot-single")
    data = one(t, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert data["InstanceMarketOptions"] == {"MarketType": "spot", "SpotOptions": {
        "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    assert data["InstanceType"] == "g5.xlarge"
    group = one(t, "AWS::AutoScaling::AutoScalingGroup")
    assert "MixedInstancesPolicy" not in group and group["LaunchTemplate"]["LaunchTemplateId"] == {
        "Ref": "LaunchTemplate"}
    # One type in one AZ is one spot pool: Capacity Rebalancing would replace an at-risk instance from
    # that same pool (issue 24.4). The agent still checkpoints on the recommendation.
    assert group["CapacityRebalance"] is False


def test_several_types_use_a_price_capacity_optimized_mixed_instances_policy(templates, tmp_path):
    t = job(templates, "spot-mixed")
    data = one(t, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert "InstanceMarketOptions" not in data  # AWS rejects market options inside a mixed-instances policy
    policy = one(t, "AWS::AutoScaling::AutoScalingGroup")["MixedInstancesPolicy"]
    dist = policy["InstancesDistribution"]
    assert dist["SpotAllocationStrategy"] == "price-capacity-optimized"  # AWS's recommendation for spot
    assert dist["OnDemandBaseCapacity"] == 1 and dist["OnDemandPercentageAboveBaseCapacity"] == 0
    assert [o["InstanceType"] for o in policy["LaunchTemplate"]["Overrides"]] == ["g5.xlarge", "g5.2xlarge",
                                                                                  "g5.4xlarge"]
    assert one(t, "AWS::AutoScaling::AutoScalingGroup")["CapacityRebalance"] is True  # several pools
    spec = rendered.job_spec("spot-mixed")
    spec.spot_strategy = "capacity-optimized"  # still selectable (run_job --spot-strategy)
    agent = rendered.AgentConfig(job=spec, node_id="", asg_name="petctl-job-spot-mixed")
    text = rendered.provider(tmp_path).render_job_template(spec, agent, "s3://b/jobs/spot-mixed/agent.json")
    policy = one(parse(text), "AWS::AutoScaling::AutoScalingGroup")["MixedInstancesPolicy"]
    assert policy["InstancesDistribution"]["SpotAllocationStrategy"] == "capacity-optimized"


def test_on_demand_has_no_spot_settings(templates):
    t = job(templates, "ondemand")
    assert "InstanceMarketOptions" not in one(t, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    group = one(t, "AWS::AutoScaling::AutoScalingGroup")
    assert "MixedInstancesPolicy" not in group and group["CapacityRebalance"] is False


@pytest.mark.parametrize("variant", list(rendered.JOB_VARIANTS))
def test_job_group_sizes_subnets_hook_and_tags(templates, variant):
    t = job(templates, variant)
    group = one(t, "AWS::AutoScaling::AutoScalingGroup")
    # Created empty (issue 11.2): a group is CREATE_COMPLETE only at its desired capacity, which run_job
    # sets once the stack exists. No DesiredCapacity means MinSize (0); updates keep the live sizes.
    assert (group["MinSize"], group["MaxSize"]) == ("0", "4") and "DesiredCapacity" not in group
    policy = t["Resources"]["Group"]["UpdatePolicy"]["AutoScalingScheduledAction"]
    assert policy == {"IgnoreUnmodifiedGroupSizeProperties": True}
    assert group["VPCZoneIdentifier"] == OUTPUTS["SubnetIds"].split(",")[:1]  # one AZ per job (all-reduce)
    assert group["AutoScalingGroupName"] == f"petctl-job-{variant}"
    hook, _launch = group["LifecycleHookSpecificationList"]
    assert hook["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["LifecycleHookName"] == "petctl-drain" and hook["DefaultResult"] == "CONTINUE"
    assert hook["HeartbeatTimeout"] >= 90  # at least the agent's save deadline (timeouts.save_deadline)
    tags = {tag["Key"]: tag for tag in group["Tags"]}
    assert tags["petctl:job"]["Value"] == variant and tags["petctl:job"]["PropagateAtLaunch"] is True


@pytest.mark.parametrize("variant", list(rendered.JOB_VARIANTS))
def test_launches_wait_in_a_hook_that_abandons_a_boot_that_never_joins(templates, variant):
    """AWS's contract (PutLifecycleHook, the lifecycle hooks guide): a launching instance waits in
    Pending:Wait, not InService, until CompleteLifecycleAction or the heartbeat timeout (30-7200 s), then
    the DefaultResult applies; ABANDON terminates it. The agent completes the hook of the name its config
    carries; the boot script abandons the same one; the role may complete its group's actions (any hook)."""
    from petctl.core.spec import Timeouts
    from petctl.providers.aws.boot import agent_config_from_script

    t = job(templates, variant)
    group = one(t, "AWS::AutoScaling::AutoScalingGroup")
    (launch,) = [h for h in group["LifecycleHookSpecificationList"]
                 if h["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_LAUNCHING"]
    assert launch["DefaultResult"] == "ABANDON"
    assert 30 <= launch["HeartbeatTimeout"] <= 7200
    assert launch["HeartbeatTimeout"] == Timeouts().boot_timeout == 900  # docs/aws.md says why 15 minutes
    stub = one(t, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]["UserData"]["Fn::Base64"]
    shipped = rendered.job_boot_script(templates[variant].parent, variant)
    assert f"KEY={shipped.key}\n" in stub and f"SHA256={shipped.sha256}\n" in stub  # what the stub runs
    script = shipped.text
    config = agent_config_from_script(script)
    assert config.launch_hook == launch["LifecycleHookName"] == "petctl-boot"
    assert f"LifecycleHookName={launch['LifecycleHookName']}&" in script
    assert "LifecycleActionResult=$1" in script
    assert "BOOT_TIMEOUT=900" in script and "BREAKER_LIMIT=3" in script
    statements = {s["Sid"]: s for s in t["Resources"]["WorkerRole"]["Properties"]["Policies"][0]
                  ["PolicyDocument"]["Statement"]}
    actions = statements["OwnLifecycleActions"]
    assert "autoscaling:CompleteLifecycleAction" in actions["Action"] and "Condition" not in actions
    assert actions["Resource"] == {"Fn::Sub": "arn:${AWS::Partition}:autoscaling:${AWS::Region}:"
                                   "${AWS::AccountId}:autoScalingGroup:*:autoScalingGroupName/"
                                   f"petctl-job-{variant}"}


def test_the_boot_breaker_may_stop_a_kept_job_too(tmp_path):
    """--keep keeps a finished job's capacity, but never a boot loop: scaling the group to 0 stays."""
    for keep in (False, True):
        t = parse(rendered.named_job_template(tmp_path, "kept", keep=keep))
        sids = {s["Sid"]: s for s in t["Resources"]["WorkerRole"]["Properties"]["Policies"][0]
                ["PolicyDocument"]["Statement"]}
        assert sids["ReleaseOwnGroupToZero"]["Condition"] == {
            "NumericEquals": {"autoscaling:MinSize": "0", "autoscaling:MaxSize": "0"}}
        assert "NoGroupChangeInstanceTypes" in sids
        assert ("ReleaseOwnGroupHook" in sids) is not keep


def test_boot_timeout_outside_the_hooks_range_is_refused(tmp_path):
    from petctl.core.errors import ValidationError
    from petctl.core.spec import JobSubmission
    from petctl.providers.aws.launch import validate

    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    for bad in (29, 7201):
        spec = rendered.job_spec("spot-single")
        spec.timeouts.boot_timeout = bad
        with pytest.raises(ValidationError, match=r"boot_timeout must be within \[30, 7200\]"):
            validate(rendered.provider(tmp_path), JobSubmission(spec, script))


@pytest.mark.parametrize("variant", list(rendered.JOB_VARIANTS))
def test_launch_template_requires_imdsv2_and_uses_the_job_profile(templates, variant):
    data = one(job(templates, variant), "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    assert data["MetadataOptions"]["HttpPutResponseHopLimit"] == 2  # the agent runs in a container
    assert data["IamInstanceProfile"] == {"Arn": {"Fn::GetAtt": ["WorkerInstanceProfile", "Arn"]}}
    assert data["SecurityGroupIds"] == [{"Fn::GetAtt": ["JobSecurityGroup", "GroupId"]}]  # its own only
    assert all(m["Ebs"]["Encrypted"] is True for m in data["BlockDeviceMappings"])
    stub = data["UserData"]["Fn::Base64"]
    assert stub.startswith("#!/bin/bash") and f"KEY=jobs/{variant}/boot-" in stub  # its own job's script
    assert f'"name": "{variant}"' in rendered.job_boot_script(templates[variant].parent, variant).text


def test_job_role_is_scoped_to_its_prefix_and_its_group(templates):
    t = job(templates, "spot-single")
    role = one(t, "AWS::IAM::Role")
    statements = {s["Sid"]: s for s in role["Policies"][0]["PolicyDocument"]["Statement"]}
    prefix = f"arn:${{AWS::Partition}}:s3:::{BUCKET}/jobs/spot-single/"
    assert statements["ReadJobPrefix"]["Resource"] == {"Fn::Sub": f"{prefix}*"}
    # issue 17.5: writes only to its own state, never to its code or the config replacements run
    assert statements["WriteJobState"]["Resource"] == [{"Fn::Sub": prefix + w} for w in (
        "checkpoints/*", "status/*", "events/*", "logs/*", "boots/*", "result.json")]
    assert statements["PruneCheckpoints"]["Resource"] == {"Fn::Sub": f"{prefix}checkpoints/*"}
    # issue 17.6: with the trailing slash, "jobs/spot-single" (which lists jobs/spot-single-x/) is refused
    assert statements["ListJobPrefix"]["Condition"] == {
        "StringLike": {"s3:prefix": ["jobs/spot-single/", "jobs/spot-single/*"]}}
    assert statements["OwnLifecycleActions"]["Resource"]["Fn::Sub"].endswith(
        ":autoScalingGroup:*:autoScalingGroupName/petctl-job-spot-single")
    assert set(statements["OwnLifecycleActions"]["Action"]) == {
        "autoscaling:CompleteLifecycleAction", "autoscaling:RecordLifecycleActionHeartbeat"}
    # issue 17.9: its own streams in the stack's log group, "<job>/<instance>"
    assert statements["OwnLogStreams"]["Resource"]["Fn::Sub"].endswith(
        ":log-group:/petctl/petctl:log-stream:spot-single/*")
    assert not any("*" in a for s in statements.values() for a in _list(s["Action"]))
    # issue 17.3: only the base stack's WorkerPolicy, no AWS managed policy (AmazonSSMManagedInstanceCore)
    assert role["ManagedPolicyArns"] == [OUTPUTS["WorkerPolicyArn"]]
    # issue 17.1: the role and its profile live under the job's own IAM path
    assert role["Path"] == one(t, "AWS::IAM::InstanceProfile")["Path"] == "/petctl/petctl/spot-single/"
    shipped = rendered.job_boot_script(templates["spot-single"].parent, "spot-single")
    assert "--log-opt awslogs-stream=spot-single/${INSTANCE_ID}" in shipped.text
    # issue 44.8: the boot script its user data fetches is its own to read, and not to write (the stub
    # checks its checksum either way); another job's role reads none of it
    from tests.aws.policy_eval import allowed, resolve

    own = resolve(role["Policies"][0]["PolicyDocument"]["Statement"], rendered.NAMES)
    other = resolve(one(job(templates, "ondemand"), "AWS::IAM::Role")["Policies"][0]["PolicyDocument"]
                    ["Statement"], rendered.NAMES)
    arn = f"arn:aws:s3:::{BUCKET}/{shipped.key}"
    assert shipped.key.startswith("jobs/spot-single/boot-")
    assert allowed(own, "s3:GetObject", arn) and not allowed(own, "s3:PutObject", arn)
    assert not allowed(other, "s3:GetObject", arn)


def _list(value) -> list:
    return value if isinstance(value, list) else [value]


# --- base stack ---------------------------------------------------------------------------------------
def test_subnets_span_azs_with_cidrs_computed_in_python(base):
    subnets = [r["Properties"] for r in resources(base, "AWS::EC2::Subnet").values()]
    assert len({s["AvailabilityZone"] for s in subnets}) == 3
    vpc = ipaddress.ip_network(one(base, "AWS::EC2::VPC")["CidrBlock"])
    nets = [ipaddress.ip_network(s["CidrBlock"]) for s in subnets]
    assert all(n.subnet_of(vpc) for n in nets)
    assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])


def test_no_launch_configurations_getazs_or_cidr_anywhere(templates):
    for t in all_templates(templates):
        assert not resources(t, "AWS::AutoScaling::LaunchConfiguration")
        keys = {k for node in walk(t) if isinstance(node, dict) for k in node}
        assert not keys & {"Fn::GetAZs", "Fn::Cidr"}


def test_no_ingress_from_the_world(templates):
    for t in all_templates(templates):
        rules = [r["Properties"] for r in resources(t, "AWS::EC2::SecurityGroupIngress").values()]
        for group in resources(t, "AWS::EC2::SecurityGroup").values():
            rules += group["Properties"].get("SecurityGroupIngress", [])
        vpc = [r["Properties"]["CidrBlock"] for r in resources(t, "AWS::EC2::VPC").values()]
        for rule in rules:
            assert rule.get("CidrIp") not in ("0.0.0.0/0",) and rule.get("CidrIpv6") not in ("::/0",)
            # only ever from another petctl group, or (the interface endpoints') from inside the VPC
            assert "SourceSecurityGroupId" in rule or (rule.get("CidrIp") in vpc and rule["FromPort"] == 443)
        assert "22" not in json.dumps([r.get("FromPort") for r in rules])  # no SSH: SSM Session Manager


def test_the_base_stack_has_no_shared_worker_group(templates):
    """Jobs used to share one worker group, all ports open among its members: any job could reach any
    other job's c10d store and NCCL sockets. Now the base stack's only groups are etcd's."""
    for t in (parse(templates["base"].read_text()), parse(templates["base-etcd3"].read_text())):
        groups = resources(t, "AWS::EC2::SecurityGroup")
        assert set(groups) == {"EtcdSecurityGroup"}
        ingress = {n: r["Properties"] for n, r in resources(t, "AWS::EC2::SecurityGroupIngress").items()}
        assert all(r["SourceSecurityGroupId"] == {"Fn::GetAtt": ["EtcdSecurityGroup", "GroupId"]}
                   for r in ingress.values())  # members among themselves; jobs bring their own rule
        assert "WorkerSecurityGroupId" not in t["Outputs"]
        etcd_group = {"Fn::GetAtt": ["EtcdSecurityGroup", "GroupId"]}
        assert t["Outputs"]["EtcdSecurityGroupId"] == {"Value": etcd_group}
    assert not resources(parse(templates["base"].read_text()), "AWS::EC2::SecurityGroupIngress")  # no peers


@pytest.mark.parametrize("variant", list(rendered.JOB_VARIANTS))
def test_each_job_has_its_own_group_admitted_to_etcd_by_a_rule_of_its_own(templates, variant):
    t = job(templates, variant)
    own = {"Fn::GetAtt": ["JobSecurityGroup", "GroupId"]}
    group = one(t, "AWS::EC2::SecurityGroup")
    assert group["VpcId"] == OUTPUTS["VpcId"]
    (https,) = group["SecurityGroupEgress"]
    assert (https["IpProtocol"], https["FromPort"], https["ToPort"], https["CidrIp"]) == ("tcp", 443, 443,
                                                                                          "0.0.0.0/0")
    assert {"Key": "petctl:job", "Value": variant} in group["Tags"]
    ingress = {n: r["Properties"] for n, r in resources(t, "AWS::EC2::SecurityGroupIngress").items()}
    assert set(ingress) == {"JobIngressFromJob", "EtcdIngressFromJob"}
    peers = ingress["JobIngressFromJob"]
    assert (peers["GroupId"], peers["SourceSecurityGroupId"], peers["IpProtocol"]) == (own, own, "-1")
    etcd = ingress["EtcdIngressFromJob"]  # created in the job stack: deleting the job deletes it
    assert (etcd["GroupId"], etcd["SourceSecurityGroupId"]) == (OUTPUTS["EtcdSecurityGroupId"], own)
    assert (etcd["IpProtocol"], etcd["FromPort"], etcd["ToPort"]) == ("tcp", 2379, 2379)
    egress = {n: r["Properties"] for n, r in resources(t, "AWS::EC2::SecurityGroupEgress").items()}
    assert {n: (e["DestinationSecurityGroupId"], e["IpProtocol"], e.get("FromPort"), e.get("ToPort"))
            for n, e in egress.items()} == {
        "JobEgressToJob": (own, "-1", None, None),
        "JobEgressToEtcd": (OUTPUTS["EtcdSecurityGroupId"], "tcp", 2379, 2379)}
    assert all(e["GroupId"] == own for e in egress.values())
    data = one(t, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert data["SecurityGroupIds"] == [own]


def test_two_jobs_share_no_security_group(templates):
    """Each job's instances are in its own group only; the one group id both templates name is etcd's
    (as the target of each job's own ingress rule)."""
    ids = []
    for variant in ("spot-single", "cpu"):
        text = json.dumps(job(templates, variant))
        ids.append({m for m in re.findall(r"sg-[0-9a-f]+", text)})
    assert ids[0] == ids[1] == {OUTPUTS["EtcdSecurityGroupId"]}


def test_bucket_is_private_encrypted_versioned_and_tls_only(base):
    bucket = one(base, "AWS::S3::Bucket")
    assert all(bucket["PublicAccessBlockConfiguration"].values()) and len(
        bucket["PublicAccessBlockConfiguration"]) == 4
    rule = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] in ("AES256", "aws:kms")
    assert bucket["VersioningConfiguration"] == {"Status": "Enabled"}
    (statement,) = one(base, "AWS::S3::BucketPolicy")["PolicyDocument"]["Statement"]
    assert statement["Effect"] == "Deny" and statement["Action"] == "s3:*" and statement["Principal"] == "*"
    assert statement["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert base["Resources"]["Bucket"]["DeletionPolicy"] == "Retain"  # teardown never deletes checkpoints


def test_etcd_host_is_one_on_demand_instance_behind_a_fixed_address(base):
    eni = one(base, "AWS::EC2::NetworkInterface")
    assert eni["PrivateIpAddress"] == "10.42.0.10" and eni["SubnetId"] == {"Ref": "Subnet0"}
    assert base["Outputs"]["EtcdEndpoint"]["Value"] == "https://10.42.0.10:2379"  # client certificates
    group = base["Resources"]["EtcdGroup"]["Properties"]
    assert (group["MinSize"], group["MaxSize"], group["DesiredCapacity"]) == ("1", "1", "1")
    assert group["VPCZoneIdentifier"] == [{"Ref": "Subnet0"}]  # the interface's AZ
    data = base["Resources"]["EtcdLaunchTemplate"]["Properties"]["LaunchTemplateData"]
    assert "InstanceMarketOptions" not in data and data["MetadataOptions"]["HttpTokens"] == "required"
    head, bucket, tail = data["UserData"]["Fn::Base64"]["Fn::Join"][1]
    assert bucket == {"Ref": "Bucket"} and head.endswith('PETCTL_BUCKET="') and tail.startswith('"\n')
    assert "KEY=dist/etcd/boot-" in tail and "@@" not in head + tail  # the boot script, from the bucket
    assert data["InstanceInitiatedShutdownBehavior"] == "terminate"  # a failed host is replaced


def test_instance_roles_may_mark_only_their_own_group_unhealthy(base, templates):
    etcd = base["Resources"]["EtcdRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
    etcd = {s["Sid"]: s for s in etcd}
    assert etcd["MarkOwnHostUnhealthy"]["Action"] == "autoscaling:SetInstanceHealth"
    assert etcd["MarkOwnHostUnhealthy"]["Resource"]["Fn::Sub"].endswith(
        ":autoScalingGroup:*:autoScalingGroupName/petctl-etcd")
    assert etcd["FetchEtcdBinary"] == {"Sid": "FetchEtcdBinary", "Effect": "Allow", "Action": "s3:GetObject",
                                       "Resource": {"Fn::Sub": "${Bucket.Arn}/dist/etcd/*"}}
    t = job(templates, "spot-single")
    worker = {s["Sid"]: s for s in one(t, "AWS::IAM::Role")["Policies"][0]["PolicyDocument"]["Statement"]}
    assert worker["MarkOwnInstanceUnhealthy"]["Action"] == "autoscaling:SetInstanceHealth"
    assert worker["MarkOwnInstanceUnhealthy"]["Resource"]["Fn::Sub"].endswith(
        ":autoScalingGroup:*:autoScalingGroupName/petctl-job-spot-single")
    data = one(t, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert data["InstanceInitiatedShutdownBehavior"] == "terminate"


def test_etcd_role_can_only_move_interfaces_of_its_stack(base):
    role = base["Resources"]["EtcdRole"]["Properties"]
    statements = {s["Sid"]: s for s in role["Policies"][0]["PolicyDocument"]["Statement"]}
    attach = statements["AttachOwnInterface"]
    assert attach["Condition"] == {"StringEquals": {"aws:ResourceTag/petctl:stack": "petctl"}}
    assert set(statements["Describe"]["Action"]) == {"ec2:DescribeNetworkInterfaces", "ec2:DescribeInstances"}


def test_worker_policy_pulls_only_its_repository_and_opens_only_session_manager(base):
    statements = {s["Sid"]: s for s in base["Resources"]["WorkerPolicy"]["Properties"]["PolicyDocument"][
        "Statement"]}
    assert statements["EcrPull"]["Resource"] == {"Fn::GetAtt": ["Repository", "Arn"]}
    assert "AgentLogs" not in statements  # log streams are each job's own (job stack, issue 17.9)
    assert [s for s in statements.values() if s["Resource"] == "*"] == [statements["EcrLogin"],
                                                                        statements["SessionManagerChannels"]]
    assert all(a.startswith("ssmmessages:") for a in statements["SessionManagerChannels"]["Action"])
    assert statements["SessionManagerRegistration"]["Action"] == "ssm:UpdateInstanceInformation"
    assert not any(a.startswith("ssm:Get") for s in statements.values() for a in _list(s["Action"]))


def test_checkov_skips_each_carry_a_reason(templates):
    for t in all_templates(templates):
        for resource in t["Resources"].values():
            for skip in resource.get("Metadata", {}).get("checkov", {}).get("skip", []):
                assert skip["id"].startswith("CKV") and len(skip["comment"]) > 30


# --- linters on the rendered output -------------------------------------------------------------------
def test_cfn_lint_reports_no_errors_or_warnings(templates):
    api = pytest.importorskip("cfnlint.api", reason="cfn-lint is not installed (pip install cfn-lint)")
    for name, path in templates.items():
        matches = api.lint(path.read_text(), config=api.ManualArgs(regions=["us-east-1"]))
        problems = [f"{m.rule.id} {m.message} (line {m.linenumber})" for m in matches
                    if m.rule.id[0] in "EW"]
        assert problems == [], f"cfn-lint on {name}: {problems}"


def test_checkov_passes(templates):
    checkov = shutil.which("checkov")
    if checkov is None:
        pytest.skip("checkov is not installed (it pins old boto3/packaging: install it in its own venv and "
                    "put it on PATH)")
    directory = templates["base"].parent
    out = subprocess.run([checkov, "-d", str(directory), "--framework", "cloudformation", "-o", "json",
                          "--quiet", "--skip-download"], capture_output=True, text=True, timeout=300)
    reports = json.loads(out.stdout)
    for report in reports if isinstance(reports, list) else [reports]:
        failed = [(c["check_id"], c["resource"]) for c in report.get("results", {}).get("failed_checks", [])]
        assert failed == []


def test_user_data_is_base64_encodable_and_small(templates):
    for variant in rendered.JOB_VARIANTS:
        script = one(job(templates, variant), "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]["UserData"]
        # EC2: "User data is limited to 16 KB, in raw form, before it is base64-encoded"
        assert len(script["Fn::Base64"].encode()) <= 16 * 1024
        assert len(base64.b64encode(script["Fn::Base64"].encode())) <= 21847  # the API's base64 limit


def test_multi_az_job_group_spans_every_subnet(tmp_path):
    spec = rendered.job_spec("spot-single")
    spec.multi_az = True
    agent = rendered.AgentConfig(job=spec, node_id="", host_addr="", asg_name="petctl-job-spot-single")
    text = rendered.provider(tmp_path).render_job_template(spec, agent, "s3://b/jobs/spot-single/agent.json")
    group = one(parse(text), "AWS::AutoScaling::AutoScalingGroup")
    assert group["VPCZoneIdentifier"] == OUTPUTS["SubnetIds"].split(",")
    assert group["CapacityRebalance"] is True  # one type, but a pool per AZ


@pytest.mark.parametrize(("types", "on_demand", "multi_az", "expected"), [
    (["g5.xlarge"], False, False, False),  # the default job: one pool, nothing to rebalance to
    (["g5.xlarge", "g5.2xlarge"], False, False, True),
    (["g5.xlarge"], False, True, True),
    (["g5.xlarge", "g5.2xlarge"], True, True, False),  # on-demand: no recommendations to act on
])
def test_capacity_rebalancing_only_with_several_types_or_azs(tmp_path, types, on_demand, multi_az, expected):
    spec = rendered.job_spec("spot-single")
    spec.instance_types, spec.on_demand, spec.multi_az = types, on_demand, multi_az
    agent = rendered.AgentConfig(job=spec, node_id="", host_addr="", asg_name="petctl-job-spot-single")
    text = rendered.provider(tmp_path).render_job_template(spec, agent, "s3://b/jobs/spot-single/agent.json")
    assert one(parse(text), "AWS::AutoScaling::AutoScalingGroup")["CapacityRebalance"] is expected


# --- base stack with a 3-member etcd (setup --etcd-nodes 3) --------------------------------------------
@pytest.fixture(scope="module")
def cluster(templates) -> dict:
    return parse(templates["base-etcd3"].read_text())


def test_templates_go_by_url_and_only_the_seed_goes_inline(templates):
    """Issue 44.8: the largest base template (the longest name, private subnets, 3 etcd members) was within
    2 KB of CloudFormation's 51,200-byte TemplateBody. Every full template now goes by TemplateURL (1 MB at
    most); only the seed, the bucket alone, goes inline, and it is far from the limit."""
    from petctl.providers.aws.templates import TEMPLATE_BODY_LIMIT, TEMPLATE_URL_LIMIT

    for name, path in templates.items():
        assert len(path.read_bytes()) < TEMPLATE_URL_LIMIT // 4, name
    assert len(templates["seed"].read_bytes()) < TEMPLATE_BODY_LIMIT // 8


def test_the_seed_makes_the_very_bucket_and_policy_the_full_template_declares(templates):
    """The update from the seed to the full template must leave the bucket alone: the same logical ids,
    type, deletion policies and properties, in every variant of the base template; and nothing else."""
    seed = parse(templates["seed"].read_text())
    assert set(seed["Resources"]) == {"Bucket", "BucketPolicy"}
    assert seed["Outputs"] == {"BucketName": {"Value": {"Ref": "Bucket"}}}
    for name in ("base", "base-etcd3", "base-private"):  # the seed is rendered for the default stack name
        full = parse(templates[name].read_text())
        for logical in ("Bucket", "BucketPolicy"):
            assert full["Resources"][logical] == seed["Resources"][logical], (name, logical)
    seed_long = parse(rendered.seed_template(rendered.LONG_STACK))
    full_long = parse(templates["base-largest"].read_text())
    assert all(full_long["Resources"][k] == seed_long["Resources"][k] for k in ("Bucket", "BucketPolicy"))


def test_a_template_over_the_inline_limit_is_refused_before_any_call():
    from petctl.core.errors import ProviderError
    from petctl.providers.aws.stacks import Template

    with pytest.raises(ProviderError, match="cannot go inline"):
        Template(body="x" * 51_201).args()
    assert Template(body="{}").args() == {"TemplateBody": "{}"}
    assert Template(body="x" * 60_000, url="https://b.s3.us-east-1.amazonaws.com/k").args() == {
        "TemplateURL": "https://b.s3.us-east-1.amazonaws.com/k"}


@pytest.mark.parametrize(("region", "url"), [
    ("us-east-1", "https://petctl-bucket.s3.us-east-1.amazonaws.com/templates/base-0123.yaml"),
    ("eu-central-1", "https://petctl-bucket.s3.eu-central-1.amazonaws.com/templates/base-0123.yaml"),
    ("cn-north-1", "https://petctl-bucket.s3.cn-north-1.amazonaws.com.cn/templates/base-0123.yaml"),
])
def test_template_urls_are_the_buckets_regional_https_address(region, url):
    """CloudFormation's TemplateURL contract (CreateStack API reference, the console's "Amazon S3 URL"):
    an https:// S3 URL (no website endpoint), at most 1,024 characters, to an object of 1 MB at most."""
    from petctl.core.errors import ProviderError
    from petctl.providers.aws.stacks import template_key, template_url

    assert template_url("petctl-bucket", region, "templates/base-0123.yaml") == url
    key = template_key("templates", "base", "a: 1\n")
    assert re.fullmatch(r"templates/base-[0-9a-f]{16}\.yaml", key)
    assert key == template_key("templates", "base", "a: 1\n") != template_key("templates", "base", "a: 2\n")
    with pytest.raises(ProviderError, match="1024"):
        template_url("b" * 63, "us-east-1", "k" * 1000)


def test_the_base_template_sheds_its_comments_and_nothing_else():
    from petctl.providers.aws.templates import CFN_DIR, render, strip_comments

    assert strip_comments("a: 1\n  # why\nb: '# kept'\n") == "a: 1\nb: '# kept'\n"
    text = rendered.base_template(etcd_nodes=3, private=True, stack=rendered.LONG_STACK)
    assert not any(line.lstrip().startswith("#") for line in text.splitlines())
    # what CloudFormation parses is the same with or without the comments (no block scalar lost a line)
    from petctl.providers.aws.jobscope import base_scope

    plan, hosts, _ = rendered._etcd_hosts(3, 3, True, rendered.LONG_STACK)
    full = render(CFN_DIR, "base.yaml.j2", **base_scope(rendered.LONG_STACK), stack_name=rendered.LONG_STACK,
                  plan=plan, etcd_ami="ami-0123456789abcdef0", etcd_instance_type="t3.small",
                  bucket_placeholder=rendered.BUCKET_PLACEHOLDER, etcd_members=hosts,
                  repository_name=f"{rendered.LONG_STACK}-worker", noncurrent_days=1, log_retention_days=14)
    assert parse(full) == parse(text)


def test_three_etcd_members_each_in_its_own_subnet_behind_its_own_fixed_address(cluster):
    enis = resources(cluster, "AWS::EC2::NetworkInterface")
    assert sorted(enis) == ["EtcdNetworkInterface", "EtcdNetworkInterface1", "EtcdNetworkInterface2"]
    members = {}
    for suffix, name, ip, subnet in [("", "petctl-0", "10.42.0.10", "Subnet0"),
                                     ("1", "petctl-1", "10.42.16.10", "Subnet1"),
                                     ("2", "petctl-2", "10.42.32.10", "Subnet2")]:
        eni = enis[f"EtcdNetworkInterface{suffix}"]["Properties"]
        assert (eni["PrivateIpAddress"], eni["SubnetId"]) == (ip, {"Ref": subnet})
        assert {"Key": "petctl:etcd-member", "Value": name} in eni["Tags"]
        group = cluster["Resources"][f"EtcdGroup{suffix}"]
        assert group["DependsOn"] == f"EtcdNetworkInterface{suffix}"
        props = group["Properties"]
        assert (props["MinSize"], props["MaxSize"]) == ("1", "1")
        assert props["VPCZoneIdentifier"] == [{"Ref": subnet}]
        assert props["LaunchTemplate"]["LaunchTemplateId"] == {"Ref": f"EtcdLaunchTemplate{suffix}"}
        data = cluster["Resources"][f"EtcdLaunchTemplate{suffix}"]["Properties"]["LaunchTemplateData"]
        assert data["IamInstanceProfile"] == {"Arn": {"Fn::GetAtt": [f"EtcdInstanceProfile{suffix}", "Arn"]}}
        head, bucket, _ = data["UserData"]["Fn::Base64"]["Fn::Join"][1]
        assert bucket == {"Ref": "Bucket"} and f"PETCTL_ETCD_MEMBER={suffix or 0} " in head
        members[name] = props["AutoScalingGroupName"]
    assert members == {"petctl-0": "petctl-etcd", "petctl-1": "petctl-etcd-1", "petctl-2": "petctl-etcd-2"}
    assert cluster["Outputs"]["EtcdEndpoint"]["Value"] == (
        "https://10.42.0.10:2379,https://10.42.16.10:2379,https://10.42.32.10:2379")


def test_each_etcd_member_may_claim_only_its_own_interface_and_mark_only_its_own_group(cluster):
    for suffix, name, group in [("", "petctl-0", "petctl-etcd"), ("1", "petctl-1", "petctl-etcd-1"),
                                ("2", "petctl-2", "petctl-etcd-2")]:
        role = cluster["Resources"][f"EtcdRole{suffix}"]["Properties"]
        statements = {s["Sid"]: s for s in role["Policies"][0]["PolicyDocument"]["Statement"]}
        own = statements["AttachOwnInterface"]
        assert own["Resource"]["Fn::Sub"].endswith(f":network-interface/${{EtcdNetworkInterface{suffix}}}")
        instances = statements["ToOwnInstances"]
        assert instances["Resource"]["Fn::Sub"].endswith(":instance/*")
        assert instances["Condition"] == {"StringEquals": {"aws:ResourceTag/petctl:stack": "petctl",
                                                           "aws:ResourceTag/petctl:etcd-member": name}}
        assert statements["MarkOwnHostUnhealthy"]["Resource"]["Fn::Sub"].endswith(
            f":autoScalingGroupName/{group}")
        everywhere = [s["Sid"] for s in statements.values() if s["Resource"] == "*"]
        # Describe calls and Session Manager's channels have no resource scope; no ListSecrets (issue 24.2:
        # it would show every secret name in the account): the job users come from the bucket's index
        assert everywhere == ["Describe", "SessionManagerChannels"]
        assert "ManagedPolicyArns" not in role  # no AmazonSSMManagedInstanceCore (issue 17.3)
        assert not any(a.startswith("secretsmanager:List") for s in statements.values()
                       for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))
        index = statements["ListJobUsers"]
        assert (index["Action"], index["Resource"]) == ("s3:ListBucket", {"Fn::GetAtt": ["Bucket", "Arn"]})
        assert index["Condition"] == {"StringEquals": {"s3:prefix": "etcd-users/"}}
        assert statements["ReadEtcdHostCertificates"]["Resource"]["Fn::Sub"].endswith(
            ":secret:petctl/etcd/host-??????")  # the hosts' own secret, never the operator's or a job's
        tags = cluster["Resources"][f"EtcdLaunchTemplate{suffix}"]["Properties"]["LaunchTemplateData"][
            "TagSpecifications"][0]["Tags"]
        assert {"Key": "petctl:etcd-member", "Value": name} in tags


def test_etcd_members_reach_each_other_on_2379_2380_and_workers_only_the_client_port(cluster):
    ingress = {n: r["Properties"] for n, r in resources(cluster, "AWS::EC2::SecurityGroupIngress").items()}
    assert set(ingress) == {"EtcdIngressFromEtcd"}
    peers = ingress["EtcdIngressFromEtcd"]
    etcd_sg = {"Fn::GetAtt": ["EtcdSecurityGroup", "GroupId"]}
    assert (peers["GroupId"], peers["SourceSecurityGroupId"]) == (etcd_sg, etcd_sg)
    assert (peers["IpProtocol"], peers["FromPort"], peers["ToPort"]) == ("tcp", 2379, 2380)
    egress = resources(cluster, "AWS::EC2::SecurityGroupEgress")["EtcdEgressToEtcd"]["Properties"]
    assert egress["DestinationSecurityGroupId"] == etcd_sg
    assert (egress["FromPort"], egress["ToPort"]) == (2379, 2380)


def test_one_etcd_host_keeps_its_logical_ids_and_has_no_peer_rules(base):
    etcd = [n for n in base["Resources"] if n.startswith("Etcd")]
    assert sorted(etcd) == ["EtcdGroup", "EtcdInstanceProfile",
                            "EtcdLaunchTemplate", "EtcdNetworkInterface", "EtcdRole", "EtcdSecurityGroup"]


def test_a_job_role_may_read_its_own_etcd_credentials_and_nothing_else_of_secrets_manager(tmp_path):
    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:petctl/etcd/jobs/spot-single/0000000a-AbCdEf"
    spec = rendered.job_spec("spot-single")
    spec.etcd_credentials = arn
    agent = rendered.AgentConfig(job=spec, node_id="", host_addr="", asg_name="petctl-job-spot-single")
    t = parse(rendered.provider(tmp_path).render_job_template(spec, agent, "s3://b/jobs/spot-single/agent.json"))
    statements = one(t, "AWS::IAM::Role")["Policies"][0]["PolicyDocument"]["Statement"]
    secrets = [s for s in statements if "secretsmanager" in json.dumps(s["Action"])]
    assert secrets == [{"Sid": "ReadOwnEtcdCredentials", "Effect": "Allow",
                        "Action": "secretsmanager:GetSecretValue", "Resource": arn}]


# --- private subnets (setup --option subnets=private, issue 17.8) ---------------------------------------
def test_public_subnets_by_default_with_no_interface_endpoints(base):
    subnets = resources(base, "AWS::EC2::Subnet").values()
    assert all(s["Properties"]["MapPublicIpOnLaunch"] is True for s in subnets)
    assert one(base, "AWS::EC2::Route")["GatewayId"] == {"Ref": "InternetGateway"}
    endpoints = [e["Properties"] for e in resources(base, "AWS::EC2::VPCEndpoint").values()]
    assert [e["VpcEndpointType"] for e in endpoints] == ["Gateway"]  # S3's, free


def test_private_subnets_have_no_public_address_no_route_out_and_reach_aws_through_endpoints(templates):
    from petctl.providers.aws.network import INTERFACE_ENDPOINTS

    t = parse(templates["base-private"].read_text())
    subnets = resources(t, "AWS::EC2::Subnet").values()
    assert all(s["Properties"]["MapPublicIpOnLaunch"] is False for s in subnets)
    assert not resources(t, "AWS::EC2::InternetGateway") and not resources(t, "AWS::EC2::Route")
    assert not resources(t, "AWS::EC2::NatGateway")
    endpoints = {e["Properties"]["ServiceName"]["Fn::Sub"].rsplit(".", 1)[-1] if e["Properties"][
        "VpcEndpointType"] == "Gateway" else e["Properties"]["ServiceName"]["Fn::Sub"].split("}.", 1)[1]: e[
        "Properties"] for e in resources(t, "AWS::EC2::VPCEndpoint").values()}
    assert set(endpoints) == {"s3", *INTERFACE_ENDPOINTS}
    # every API an instance calls: image pull, logs, Session Manager, Auto Scaling, the etcd host's EC2 calls
    assert {"ecr.api", "ecr.dkr", "logs", "ssm", "ssmmessages", "autoscaling", "ec2"} <= set(endpoints)
    subnets = [{"Ref": name} for name in resources(t, "AWS::EC2::Subnet")]
    for service in INTERFACE_ENDPOINTS:
        e = endpoints[service]
        assert e["VpcEndpointType"] == "Interface" and e["PrivateDnsEnabled"] is True
        assert e["SubnetIds"] == subnets  # one ENI per AZ
        assert e["SecurityGroupIds"] == [{"Fn::GetAtt": ["EndpointSecurityGroup", "GroupId"]}]
    group = t["Resources"]["EndpointSecurityGroup"]["Properties"]
    (ingress,) = group["SecurityGroupIngress"]
    vpc = one(t, "AWS::EC2::VPC")["CidrBlock"]
    assert (ingress["CidrIp"], ingress["FromPort"], ingress["ToPort"]) == (vpc, 443, 443)


# --- the longest names petctl accepts (issue 17.1) ------------------------------------------------------
def test_the_longest_stack_and_job_names_fit_every_name_and_the_service_roles_scope(templates):
    from petctl.providers.aws.jobscope import job_iam_path

    assert len(rendered.LONG_STACK) == 24 and len(rendered.LONG_JOB) == 32
    t = parse(templates["job-long"].read_text())
    role = one(t, "AWS::IAM::Role")
    assert role["Path"] == job_iam_path(rendered.LONG_STACK, rendered.LONG_JOB) and len(role["Path"]) <= 512
    assert "RoleName" not in role  # CloudFormation names it (cut at 64): the scope never depends on it
    name = f"{rendered.LONG_STACK}-job-{rendered.LONG_JOB}"
    assert len(name) <= 128  # the stack's own name (CloudFormation's limit)
    assert one(t, "AWS::AutoScaling::AutoScalingGroup")["AutoScalingGroupName"] == name
    assert one(t, "AWS::EC2::LaunchTemplate")["LaunchTemplateName"] == name
    service = parse(templates["base-long"].read_text())["Resources"]["JobStackRole"]["Properties"]
    scope = json.dumps(service["Policies"])
    assert f"role/petctl/{rendered.LONG_STACK}/*" in scope and role["Path"].startswith(
        f"/petctl/{rendered.LONG_STACK}/")


def test_a_jobs_arguments_and_environment_do_not_grow_its_template(tmp_path):
    """Issue 44.8: the job's config travels in its boot script (the job's prefix), not in the template's
    user data: a 64 KB environment, which EC2's 16 KB of user data could never hold, leaves the job
    template's size as it is (only the checksum the stub pins differs)."""
    spec = rendered.job_spec("spot-mixed")
    spec.name = rendered.LONG_JOB
    agent = rendered.AgentConfig(job=spec, node_id="", host_addr="", asg_name=f"{rendered.LONG_STACK}-job-x")
    render = rendered.provider(tmp_path, rendered.LONG_STACK).render_job_template
    small = render(spec, agent, "s3://b/jobs/x/agent.json")
    spec.env = {"PAYLOAD": "\"\\n" * 64 * 1024}
    big = render(spec, agent, "s3://b/jobs/x/agent.json")
    assert len(big.encode()) == len(small.encode()) and "PAYLOAD" not in big
