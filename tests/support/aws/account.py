"""The emulated AWS account (moto on loopback) as the AWS tests reach it: clients, every stack, the DLAMI
AWS publishes, an image pushed to ECR, and a job submitted the way `petctl run_job` submits it."""

from __future__ import annotations

import json
from pathlib import Path

from petctl.core.spec import JobSpec, JobSubmission

REGION = "us-east-1"

DLAMI_NAME = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023) 20261003"
DLAMI_DESCRIPTION = ("Supported EC2 instances: G4dn, G5, G6, Gr6, G6e, P4, P4de, P5, P5e, P5en, P6-B200. "
                     "PyTorch-2.13, NVIDIA driver 595.91.07, CUDA version 13.0")


def publish_dlami(moto: str, name: str = DLAMI_NAME, description: str = DLAMI_DESCRIPTION) -> str:
    """What AWS publishes: a DLAMI, and its ID in the public SSM parameter amis.DLAMI_PARAM. Nobody may
    put a parameter under /aws/ (moto refuses it, as AWS does), so it goes into moto's backend directly
    (the server runs in this process). The newest value wins, as in AWS. Returns the AMI's ID."""
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.core.utils import utcnow
    from moto.ssm.models import Parameter, ssm_backends

    from petctl.providers.aws.boot import DLAMI_PARAM

    image_id = boto(moto, "ec2").register_image(Name=name, Description=description, Architecture="x86_64",
                                                RootDeviceName="/dev/xvda")["ImageId"]
    versions = ssm_backends[DEFAULT_ACCOUNT_ID][REGION]._parameters[DLAMI_PARAM]
    versions.append(Parameter(account_id=DEFAULT_ACCOUNT_ID, name=DLAMI_PARAM, value=image_id,
                              parameter_type="String", description=None, allowed_pattern=None, keyid=None,
                              last_modified_date=utcnow(), version=len(versions) + 1,
                              data_type="aws:ec2:image"))
    return image_id


def push_worker_image(moto: str, image: str, architecture: str = "amd64") -> None:
    """What `docker buildx build --platform linux/<architecture> --push` leaves in ECR, as far as its API
    can tell: an OCI image index naming the image's platform, and an attestation entry (unknown/unknown)."""
    repository, tag = image.split("/", 1)[1].rsplit(":", 1)
    entry = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "size": 1}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {**entry, "digest": "sha256:" + "1" * 64, "platform": {"architecture": architecture, "os": "linux"}},
        {**entry, "digest": "sha256:" + "2" * 64, "platform": {"architecture": "unknown", "os": "unknown"}}]}
    boto(moto, "ecr").put_image(repositoryName=repository, imageManifest=json.dumps(index), imageTag=tag,
                                imageManifestMediaType=index["mediaType"])


def worker_image(provider) -> str:
    """The base stack's repository, at this petctl's version: where a user pushes an --image."""
    from petctl import __version__

    return f"{provider.settings['outputs']['RepositoryUri']}:{__version__}"


def boto(moto: str, service: str):
    import boto3

    return boto3.client(service, region_name=REGION, endpoint_url=moto)


def all_stacks(moto: str) -> list[dict]:
    """Every stack in the emulator, all pages: the module's tests share one emulator, and DescribeStacks
    returns 50 stacks a page (moto, like AWS, paginates), so one call misses stacks once there are more."""
    pages = boto(moto, "cloudformation").get_paginator("describe_stacks").paginate()
    return [stack for page in pages for stack in page["Stacks"]]


def write_script(directory: Path, name: str = "train.py", text: str = "print('hello')\n") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    return path


def submit(spec: JobSpec, script: Path, **options) -> JobSubmission:
    """What `petctl run_job` hands the provider: the spec, the script and the options outside the spec."""
    return JobSubmission(spec, Path(script), **options)


def view(provider, job: str):
    """The read side of `job` on `provider`, as the CLI opens it (status, events, logs)."""
    from petctl.providers import job_view

    return job_view(provider, job)
