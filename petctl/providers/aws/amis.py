"""Which AMI a job's instances boot, and which torch and CUDA that gives them.

The default path needs no image: instances boot the AWS Deep Learning AMI for PyTorch (GPU, Amazon Linux
2023), whose `/opt/pytorch` Python already has a CUDA torch, and install the petctl that launched them
(wheelhouse.py). AWS publishes each DLAMI line's current ID as a public SSM parameter; the line is named by
its PyTorch version, so the torch a job gets is pinned here (DLAMI_TORCH, one line to bump) and checked
against the range setup.py declares. `--image` jobs keep the ECS-optimized GPU AMI, which has Docker and
the NVIDIA container toolkit; their torch is the image's. A `worker_ami` setup option overrides both.

Facts (AWS DLAMI release notes, "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023)",
release of 2026-10-03, https://docs.aws.amazon.com/dlami/latest/devguide/ release notes for gpupt213oss
al2023): framework_version 2.13, python_location /opt/pytorch/bin/python, x86_64, NVIDIA driver 595.91.07.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from petctl.core.errors import ProviderError

DLAMI_TORCH = "2.13"
DLAMI_PARAM = (f"/aws/service/deeplearning/ami/x86_64/oss-nvidia-driver-gpu-pytorch-{DLAMI_TORCH}"
               "-amazon-linux-2023/latest/ami-id")
CONTAINER_AMI_PARAM = "/aws/service/ecs/optimized-ami/amazon-linux-2023/gpu/recommended/image_id"
AMI_PYTHON = "/opt/pytorch/bin/python"  # the DLAMI's Python, with its CUDA torch
# The torch petctl supports: setup.py's extras declare the same range (tests/test_torch_range.py).
TORCH_FLOOR = (2, 5)
TORCH_CEILING = (3, 0)  # exclusive
TORCH_RANGE = ">=2.5,<3"


@dataclass(frozen=True)
class WorkerAmi:
    image_id: str
    name: str = ""
    source: str = ""  # the SSM parameter it was resolved from, or "worker_ami option"
    torch: str = ""  # "" when the AMI does not say (a custom AMI, or an --image job: the image's torch)
    cuda: str = ""

    def summary(self) -> str:
        what = f"torch {self.torch or 'unknown'}, CUDA {self.cuda or 'unknown'}"
        return f"{self.image_id} ({self.name or 'unnamed'}): {what}"


def torch_supported(version: str) -> bool | None:
    """Whether a torch version falls in TORCH_RANGE; None when `version` is not a version."""
    match = re.match(r"^(\d+)\.(\d+)", version or "")
    if not match:
        return None
    return TORCH_FLOOR <= (int(match[1]), int(match[2])) < TORCH_CEILING


def describe(name: str, description: str) -> tuple[str, str]:
    """(torch, CUDA) as a DLAMI's name and description state them ("" where they do not). DLAMI names read
    "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023) 20261003"."""
    text = f"{name} {description}"
    torch = re.search(r"PyTorch[ -](\d+\.\d+(?:\.\d+)?)", text, re.I)
    cuda = re.search(r"CUDA(?:[ _-]?(?:version|stack))?[ :=-]*(\d+\.\d+)", text, re.I) or re.search(
        r"cuda-(\d+\.\d+)", text)
    return (torch[1] if torch else "", cuda[1] if cuda else "")


def resolve(ssm: Any, ec2: Any, settings: dict[str, Any], container: bool) -> WorkerAmi:
    """The AMI a job started now gets: the `worker_ami` option, else the DLAMI (or, for an --image job, the
    ECS GPU AMI) from AWS's public parameter, with what its name says of torch and CUDA. Raises
    ProviderError when the parameter is missing in the region, or the DLAMI's torch is outside
    TORCH_RANGE."""
    from petctl.io.aws import aws_errors
    from petctl.providers.aws.inventory import ssm_parameter

    pinned = (settings.get("options") or {}).get("worker_ami", "")
    param = CONTAINER_AMI_PARAM if container else DLAMI_PARAM
    image_id = pinned or ssm_parameter(ssm, param)
    with aws_errors(f"describe AMI {image_id}"):
        images = ec2.describe_images(ImageIds=[image_id]).get("Images", [])
    found = images[0] if images else {}
    torch, cuda = describe(found.get("Name", ""), found.get("Description", "")) if not container else ("", "")
    ami = WorkerAmi(image_id, found.get("Name", ""), "worker_ami option" if pinned else param, torch, cuda)
    if torch and torch_supported(torch) is False:
        raise ProviderError(f"AMI {ami.summary()} has a torch outside petctl's supported range "
                            f"{TORCH_RANGE}: pin another with `petctl setup --option worker_ami=ami-...`")
    return ami
