"""Render petctl's CloudFormation templates exactly as the provider would, without any AWS call, and
parse them (short-form intrinsics included) for property tests, cfn-lint and checkov."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from petctl.core.spec import AgentConfig, JobSpec
from petctl.io.config import PetctlConfig
from petctl.providers.aws.boot import BUCKET_PLACEHOLDER, WORKER_IMDS, etcd_hosts
from petctl.providers.aws.etcdbin import EtcdArtifact
from petctl.providers.aws.launch import LAUNCH_HOOK, LIFECYCLE_HOOK
from petctl.providers.aws.network import plan_network
from petctl.providers.aws.provider import AwsProvider
from petctl.providers.aws.templates import render_base

STACK = "petctl"
ETCD_SHA256 = "ab" * 32
ETCD_KEY = f"dist/etcd/v3.5.1-{ETCD_SHA256[:16]}/etcd"
BUCKET = "petctl-bucket-abc123"
OUTPUTS = {
    "BucketName": BUCKET, "SubnetIds": "subnet-0123456789abcdef0,subnet-0123456789abcdef1",
    "VpcId": "vpc-0123456789abcdef0", "EtcdSecurityGroupId": "sg-0123456789abcdef0",
    "LogGroupName": "/petctl/petctl",
    "WorkerPolicyArn": "arn:aws:iam::123456789012:policy/petctl-WorkerPolicy-ABC",
    "JobBoundaryArn": "arn:aws:iam::123456789012:policy/petctl-JobBoundary-ABC",
    "EtcdEndpoint": "https://10.42.0.10:2379",
}
JOB_VARIANTS = {  # name -> (instance types, on demand, on-demand base)
    "spot-single": (["g5.xlarge"], False, 0),
    "spot-mixed": (["g5.xlarge", "g5.2xlarge", "g5.4xlarge"], False, 1),  # same GPU: 1x A10G
    "ondemand": (["g5.xlarge"], True, 0),
    "cpu": (["c5.xlarge"], False, 0),
}


ETCDCTL_SHA256 = "cd" * 32


def _etcd_hosts(etcd_nodes: int, azs: int, private: bool = False, stack: str = STACK):
    plan = plan_network(["us-east-1a", "us-east-1b", "us-east-1c"][:azs], etcd_nodes=etcd_nodes,
                        private=private)
    etcd = EtcdArtifact(path=Path("etcd"), version="v3.5.1", sha256=ETCD_SHA256, ctl_path=Path("etcdctl"),
                        ctl_sha256=ETCDCTL_SHA256)
    assert etcd.key == ETCD_KEY
    hosts, script = etcd_hosts(stack, plan, etcd)
    return plan, hosts, script


def etcd_boot_script(etcd_nodes: int = 1, azs: int = 3):
    """The etcd boot script `setup` ships to the bucket for this stack (its hosts' user data fetches it)."""
    return _etcd_hosts(etcd_nodes, azs)[2]


def base_template(etcd_nodes: int = 1, azs: int = 3, private: bool = False, stack: str = STACK) -> str:
    plan, hosts, _ = _etcd_hosts(etcd_nodes, azs, private, stack)
    return render_base(stack_name=stack, plan=plan, etcd_ami="ami-0123456789abcdef0",
                       etcd_instance_type="t3.small", bucket_placeholder=BUCKET_PLACEHOLDER,
                       etcd_members=hosts,
                       repository_name=f"{stack}-worker", noncurrent_days=1, log_retention_days=14)


def provider(home: Path, stack: str = STACK) -> AwsProvider:
    settings = {"ready": True, "region": "us-east-1", "stack_name": stack,
                "worker_ami": "ami-0123456789abcdef0",
                "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/petctl-worker:0.1.0",
                "root_volume_gb": 100, "outputs": {**OUTPUTS, "LogGroupName": f"/petctl/{stack}"}}
    return AwsProvider(PetctlConfig(home=home, provider="aws", settings={"aws": settings}))


def job_spec(variant: str) -> JobSpec:
    types, on_demand, base = JOB_VARIANTS[variant]
    return JobSpec(name=variant, min_size=1, max_size=4, size=2, entrypoint="train.py",
                   args=["--steps", "10"], instance_types=types, on_demand=on_demand, on_demand_base=base,
                   code_url=f"s3://{BUCKET}/jobs/{variant}/code/train.py",
                   checkpoint_url=f"s3://{BUCKET}/jobs/{variant}/checkpoints",
                   etcd_endpoint=OUTPUTS["EtcdEndpoint"])


def _job_agent(variant: str) -> AgentConfig:
    return AgentConfig(job=job_spec(variant), node_id="", host_addr="", work_dir="/work",
                       imds_endpoint=WORKER_IMDS, asg_name=f"{STACK}-job-{variant}",
                       lifecycle_hook=LIFECYCLE_HOOK, launch_hook=LAUNCH_HOOK, region="us-east-1",
                       status_url=f"s3://{BUCKET}/jobs/{variant}/")


def job_template(home: Path, variant: str) -> str:
    agent = _job_agent(variant)
    return provider(home).render_job_template(agent.job, agent, f"s3://{BUCKET}/jobs/{variant}/agent.json")


def job_boot_script(home: Path, variant: str):
    """The boot script the variant's user data fetches from its job's prefix (launch.job_boot_script)."""
    from petctl.providers.aws.launch import job_boot_script as render_script

    return render_script(provider(home), _job_agent(variant), f"s3://{BUCKET}/jobs/{variant}/agent.json")


def seed_template(stack: str = STACK) -> str:
    """The base stack's first template (the bucket alone), as `setup` sends it inline."""
    from petctl.providers.aws.templates import render_seed

    return render_seed(stack_name=stack, noncurrent_days=1)


def ami_job_template(home: Path, name: str = "ami", stack: str = STACK) -> str:
    """The default job's template: no --image, the Deep Learning AMI installs petctl's wheel (what
    `run_job` renders without --image; the variants above are --image jobs, the recorded setting)."""
    from petctl.providers.aws.boot import AMI_PYTHON, AmiBoot
    from petctl.providers.aws.launch import JobBoot, render_job_template

    spec = job_spec("spot-single")
    spec.name = name
    prefix = f"s3://{BUCKET}/jobs/{name}"
    spec.code_url, spec.checkpoint_url = f"{prefix}/code/train.py", f"{prefix}/checkpoints"
    agent = AgentConfig(job=spec, node_id="", host_addr="", work_dir="/var/lib/petctl/work",
                        imds_endpoint=WORKER_IMDS, asg_name=f"{stack}-job-{name}",
                        lifecycle_hook=LIFECYCLE_HOOK, launch_hook=LAUNCH_HOOK, region="us-east-1",
                        status_url=f"{prefix}/")
    wheel = f"{prefix}/wheelhouse/petctl-0.1.0+0123456789ab-py3-none-any.whl"
    boot = JobBoot(ami="ami-0123456789abcdef0", ami_boot=AmiBoot(
        wheel_url=wheel, requirements_url=f"{prefix}/wheelhouse/requirements.txt",
        python_bin=AMI_PYTHON.rsplit("/", 1)[0]))
    return render_job_template(provider(home, stack), spec, agent, f"{prefix}/agent.json", None, boot)


def named_job_template(home: Path, name: str, stack: str = STACK, keep: bool = False) -> str:
    """The job template of a job called `name` (spot, one type) under base stack `stack`."""
    spec = job_spec("spot-single")
    spec.name, spec.keep = name, keep
    prefix = f"s3://{BUCKET}/jobs/{name}"
    spec.code_url, spec.checkpoint_url = f"{prefix}/code/train.py", f"{prefix}/checkpoints"
    agent = AgentConfig(job=spec, node_id="", host_addr="", work_dir="/work", imds_endpoint=WORKER_IMDS,
                        asg_name=f"{stack}-job-{name}", lifecycle_hook=LIFECYCLE_HOOK,
                        launch_hook=LAUNCH_HOOK, region="us-east-1",
                        status_url=f"{prefix}/")
    return provider(home, stack).render_job_template(spec, agent, f"{prefix}/agent.json")


# What the base stack's own names resolve to (tests/aws/policy_eval.resolve), for rendered templates.
NAMES = {"Bucket": BUCKET, "Bucket.Arn": f"arn:aws:s3:::{BUCKET}", "LogGroup": f"/petctl/{STACK}",
         "Repository.Arn": f"arn:aws:ecr:us-east-1:123456789012:repository/{STACK}-worker",
         "WorkerPolicy": OUTPUTS["WorkerPolicyArn"], "JobBoundary": OUTPUTS["JobBoundaryArn"],
         "Vpc": OUTPUTS["VpcId"],
         **{f"EtcdNetworkInterface{n}": f"eni-0123456789abcdef{n or 0}" for n in ("", "1", "2")}}


# The longest names petctl accepts: a 24-character stack (basestack.STACK_NAME_RE) and a 32-character job
# (spec.JOB_NAME_RE). Their templates go through cfn-lint (every name's length and pattern in the
# resource schemas) and checkov like the others.
LONG_STACK = "s" + "x" * 22 + "9"
LONG_JOB = "j" + "y" * 30 + "9"


def write_all(directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / f"{name}.yaml" for name in ("base", "base-etcd3", "base-private", "base-long",
                                                          "base-largest", "job-long", "job-ami", "seed")}
    paths["seed"].write_text(seed_template())
    paths["base"].write_text(base_template())
    paths["base-etcd3"].write_text(base_template(etcd_nodes=3))
    paths["base-private"].write_text(base_template(etcd_nodes=3, private=True))
    paths["base-long"].write_text(base_template(stack=LONG_STACK))
    # The largest base template petctl renders: the longest name, private subnets, 3 etcd members.
    paths["base-largest"].write_text(base_template(etcd_nodes=3, private=True, stack=LONG_STACK))
    paths["job-long"].write_text(named_job_template(directory, LONG_JOB, stack=LONG_STACK))
    paths["job-ami"].write_text(ami_job_template(directory))  # the default boot (no --image)
    for variant in JOB_VARIANTS:
        paths[variant] = directory / f"job-{variant}.yaml"
        paths[variant].write_text(job_template(directory, variant))
    return paths


class _CfnLoader(yaml.SafeLoader):
    """SafeLoader that turns `!Ref X` / `!GetAtt A.B` / `!Sub s` ... into their long forms."""


def _construct_tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    if suffix == "Ref":
        return {"Ref": value}
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{suffix}": value}


_CfnLoader.add_multi_constructor("!", _construct_tag)


def parse(text: str) -> dict[str, Any]:
    return yaml.load(text, Loader=_CfnLoader)  # noqa: S506 (a SafeLoader subclass)


def resources(template: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {name: r for name, r in template["Resources"].items() if r["Type"] == kind}
