"""Check `--instance-types` before any AWS call: a typo should cost a second, not a failed stack.

The family list is deliberately local (no API call): it covers the NVIDIA GPU families a training job
would use and the common CPU families (CPU-only jobs and smoke tests). All are x86_64, like the worker
image and its AMI; Graviton, Trainium/Inferentia and Gaudi need other images. A new family is one line.
"""

from __future__ import annotations

import re

from petctl.errors import ValidationError

GPU_FAMILIES = frozenset({
    "g4dn", "g5", "g6", "g6e", "gr6", "p3", "p3dn", "p4d", "p4de", "p5", "p5e", "p5en",
})
CPU_FAMILIES = frozenset({
    "t3", "t3a", "m5", "m5a", "m5n", "m6a", "m6i", "m6in", "m7a", "m7i",
    "c5", "c5a", "c5n", "c6a", "c6i", "c6in", "c7a", "c7i", "r5", "r5a", "r6a", "r6i", "r7a", "r7i",
})
KNOWN_FAMILIES = GPU_FAMILIES | CPU_FAMILIES
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


def is_gpu(instance_type: str) -> bool:
    return instance_type.split(".", 1)[0] in GPU_FAMILIES
