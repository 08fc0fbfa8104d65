"""Check `--instance-types` before any AWS call: a typo should cost a second, not a failed stack.

The family list is deliberately local (no API call): it covers the NVIDIA GPU families a training job
would use and the common CPU families (CPU-only jobs and smoke tests). All are x86_64, like the worker
image and its AMI; Graviton, Trainium/Inferentia and Gaudi need other images. A new family is one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from petctl.core.errors import ValidationError

GPU_FAMILIES = frozenset({
    "g4dn", "g5", "g6", "g6e", "gr6", "p3", "p3dn", "p4d", "p4de", "p5", "p5e", "p5en",
})
CPU_FAMILIES = frozenset({
    "t3", "t3a", "m5", "m5a", "m5n", "m6a", "m6i", "m6in", "m7a", "m7i",
    "c5", "c5a", "c5n", "c6a", "c6i", "c6in", "c7a", "c7i", "r5", "r5a", "r6a", "r6i", "r7a", "r7i",
})
KNOWN_FAMILIES = GPU_FAMILIES | CPU_FAMILIES


@dataclass(frozen=True)
class Gpus:
    """What one instance of a type offers a job: how many GPUs, of which model."""

    count: int
    model: str

    def __str__(self) -> str:
        return f"{self.count}x {self.model}"


_ONE_TO_16 = ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")
# family -> (model, {size: GPU count}); from AWS's accelerated-computing instance pages.
GPU_TABLE: dict[str, tuple[str, dict[str, int]]] = {
    "g4dn": ("T4", {**dict.fromkeys(_ONE_TO_16, 1), "12xlarge": 4, "metal": 8}),
    "g5": ("A10G", {**dict.fromkeys(_ONE_TO_16, 1), "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "g6": ("L4", {**dict.fromkeys(_ONE_TO_16, 1), "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "g6e": ("L40S", {**dict.fromkeys(_ONE_TO_16, 1), "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "gr6": ("L4", {"4xlarge": 1, "8xlarge": 1}),
    "p3": ("V100", {"2xlarge": 1, "8xlarge": 4, "16xlarge": 8}),
    "p3dn": ("V100 32GB", {"24xlarge": 8}),
    "p4d": ("A100 40GB", {"24xlarge": 8}),
    "p4de": ("A100 80GB", {"24xlarge": 8}),
    "p5": ("H100", {"4xlarge": 1, "48xlarge": 8}),
    "p5e": ("H200", {"48xlarge": 8}),
    "p5en": ("H200", {"48xlarge": 8}),
}
TYPE_RE = re.compile(r"^(?P<family>[a-z][a-z0-9-]*?)\.(?P<size>nano|micro|small|medium|large|xlarge|"
                     r"[1-9][0-9]*xlarge|metal(-[0-9]+xl)?)$")
DEFAULT_INSTANCE_TYPE = "g5.xlarge"


def validate_instance_types(types: list[str]) -> list[str]:
    """Return the types (default g5.xlarge when none given), deduplicated in order, or raise."""
    types = [t.strip() for t in types if t and t.strip()] or [DEFAULT_INSTANCE_TYPE]
    seen: list[str] = []
    for instance_type in types:
        match = TYPE_RE.match(instance_type)
        if not match:
            raise ValidationError(f"invalid instance type {instance_type!r}: expected FAMILY.SIZE such as "
                                  "g5.xlarge or p4d.24xlarge")
        if match.group("family") not in KNOWN_FAMILIES:
            raise ValidationError(f"unknown instance family {match.group('family')!r} in {instance_type!r}; "
                                  f"GPU families petctl knows: {', '.join(sorted(GPU_FAMILIES))}")
        if instance_type not in seen:
            seen.append(instance_type)
    if len({is_gpu(t) for t in seen}) > 1:
        raise ValidationError(f"--instance-types mixes GPU and CPU types ({', '.join(seen)}): a job's "
                              "instances must all have GPUs or none")
    return seen


def gpus(instance_type: str) -> Gpus:
    """GPU count and model of a GPU type; ValidationError for a size petctl does not know."""
    family, size = instance_type.split(".", 1)
    model, sizes = GPU_TABLE[family]
    if size not in sizes:
        raise ValidationError(f"unknown size {instance_type!r}: {family} comes as "
                              f"{', '.join(f'{family}.{s}' for s in sizes)}")
    return Gpus(sizes[size], model)


def check_uniform_gpus(types: list[str], nproc_per_node: int) -> Gpus | None:
    """Every node of a job runs `nproc_per_node` workers with one GPU each, and DDP wants the same GPU
    on every rank: mixed types must have the same GPU count and model. None for a CPU job."""
    if not is_gpu(types[0]):
        return None
    per_type = {t: gpus(t) for t in types}
    if len(set(per_type.values())) > 1:
        listed = ", ".join(f"{t} ({g})" for t, g in per_type.items())
        raise ValidationError(f"--instance-type values must have the same GPU count and model: {listed}")
    first = per_type[types[0]]
    if nproc_per_node > first.count:
        raise ValidationError(f"--nproc-per-node {nproc_per_node} exceeds the {first} of {types[0]}")
    return first


def is_gpu(instance_type: str) -> bool:
    return instance_type.split(".", 1)[0] in GPU_FAMILIES
