"""EC2 vCPU quotas, checked before `run_job` creates anything: with the spot quota at 0 (the default for
GPU families on a new account) an Auto Scaling group can never launch, and nothing else would say why.

Quota codes (Service Quotas, service `ec2`), per the EC2 documentation's quota names:
spot - L-34B43A08 "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
L-3819A6DF "All G and VT Spot Instance Requests", L-7212CCBC "All P4, P3 and P2 Spot Instance Requests",
L-C4BD4855 "All P5 Spot Instance Requests"; on-demand - L-1216C47A "Running On-Demand Standard (A, C, D,
H, I, M, R, T, Z) instances", L-DB2E81BA "Running On-Demand G and VT instances", L-417A185B "Running
On-Demand P instances". Quotas count vCPUs.

`assess` is pure (types, vCPUs, quota values -> verdict); `fetch` does the calls and turns an endpoint
without the API (an emulator), a missing permission or an unknown code into "unknown", which is a
warning, never a failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

QUOTAS = {  # market -> (quota code, name, instance-family pattern)
    "spot": (
        ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", r"[acdhimrtz]\d"),
        ("L-3819A6DF", "All G and VT Spot Instance Requests", r"(g|gr|vt)\d"),
        ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests", r"p[234]"),
        ("L-C4BD4855", "All P5 Spot Instance Requests", r"p5"),
    ),
    "on-demand": (
        ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", r"[acdhimrtz]\d"),
        ("L-DB2E81BA", "Running On-Demand G and VT instances", r"(g|gr|vt)\d"),
        ("L-417A185B", "Running On-Demand P instances", r"p\d"),
    ),
}


@dataclass(frozen=True)
class Quota:
    code: str
    name: str
    value: float | None  # vCPUs; None when it could not be read
    why_unknown: str = ""


@dataclass
class Verdict:
    """error: one line, set when no instance of the job can launch at all; warnings: the rest."""

    error: str = ""
    warnings: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # one per quota, for `petctl doctor`


def quota_for(instance_type: str, market: str) -> tuple[str, str] | None:
    """(code, name) of the vCPU quota an instance type draws on, or None for families not listed."""
    family = instance_type.split(".")[0]
    for code, name, pattern in QUOTAS[market]:
        if re.fullmatch(pattern + r"[a-z0-9-]*", family):
            return code, name
    return None


def assess(types: list[str], vcpus: dict[str, int], quotas: dict[str, Quota], market: str,
           size: int) -> Verdict:
    """Decide from known values only. Fails when *every* quota class the job could use is known and below
    one instance's vCPUs; warns when a quota is unknown or too small for --size instances."""
    verdict = Verdict()
    classes: dict[str, list[str]] = {}
    for t in types:
        found = quota_for(t, market)
        if found:
            classes.setdefault(found[0], []).append(t)
    blocked = []
    for code, members in classes.items():
        quota = quotas.get(code) or Quota(code, code, None, "not read")
        known = [t for t in members if t in vcpus]
        if quota.value is None or not known:
            why = quota.why_unknown or "the instance types' vCPUs are unknown"
            verdict.warnings.append(f"{market} vCPU quota {quota.code} ({quota.name}) not checked: {why}")
            verdict.lines.append(f"{quota.code} {quota.name}: unknown ({why})")
            continue
        smallest = min(known, key=lambda t: vcpus[t])
        need = vcpus[smallest]
        verdict.lines.append(f"{quota.code} {quota.name}: {quota.value:g} vCPUs "
                             f"(one {smallest} needs {need})")
        if quota.value < need:
            blocked.append(f"{quota.code} ({quota.name}) is {quota.value:g} vCPUs, below the {need} of one "
                           f"{smallest}")
        elif quota.value < need * size:
            verdict.warnings.append(f"{quota.code} ({quota.name}) is {quota.value:g} vCPUs: room for "
                                    f"{int(quota.value // need)} of the {size} {smallest} instances asked")
    if classes and len(blocked) == len(classes):
        verdict.error = (f"no instance of this job can launch: the {market} vCPU quota "
                         f"{'; '.join(blocked)}; request an increase in Service Quotas (nothing was created)")
    return verdict


def fetch_quota(servicequotas, code: str, name: str) -> Quota:
    """The account's applied value, or None with the reason it could not be read (never raises)."""
    from petctl.io.aws import BotoCoreError, ClientError, error_code, error_message

    try:
        value = servicequotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
        return Quota(code, name, float(value))
    except ClientError as exc:
        code_ = error_code(exc)
        if code_ in ("AccessDenied", "AccessDeniedException"):
            why = "not allowed to read it (servicequotas:GetServiceQuota)"
        elif code_ == "NoSuchResourceException":
            why = f"this endpoint does not report it ({error_message(exc)[:120]})"
        else:
            why = f"{code_ or 'error'}: {error_message(exc)[:120]}"
    except (BotoCoreError, NotImplementedError) as exc:
        why = f"the Service Quotas API is not available on this endpoint ({type(exc).__name__})"
    return Quota(code, name, None, why)


def instance_vcpus(ec2, types: list[str]) -> dict[str, int]:
    """Default vCPUs per instance type (DescribeInstanceTypes); {} when the call fails."""
    from petctl.io.aws import BotoCoreError, ClientError

    try:
        found = ec2.describe_instance_types(InstanceTypes=sorted(set(types)))["InstanceTypes"]
    except (BotoCoreError, ClientError):
        return {}
    return {t["InstanceType"]: int(t["VCpuInfo"]["DefaultVCpus"]) for t in found}


def check(session, types: list[str], market: str, size: int) -> Verdict:
    """Read the quotas the job's types draw on and assess them."""
    servicequotas = session.client("service-quotas", profile="probe")  # unreadable is a warning, not a wait
    codes = {quota_for(t, market) for t in types} - {None}
    quotas = {code: fetch_quota(servicequotas, code, name) for code, name in codes}
    return assess(types, instance_vcpus(session.client("ec2"), types), quotas, market, size)
