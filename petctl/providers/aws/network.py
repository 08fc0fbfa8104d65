"""The base stack's address plan, computed in Python.

CloudFormation could derive subnets with `Fn::GetAZs` and `Fn::Cidr`, but a plan computed here is
explicit in the rendered template (reviewable, testable, identical on every emulator) and lets the etcd
host's fixed address be chosen up front, which the workers' user data needs before the stack exists.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from petctl.core.errors import ProviderError, ValidationError

DEFAULT_VPC_CIDR = "10.42.0.0/16"
SUBNET_PREFIX = 20  # 4091 usable addresses per AZ: room for any job size we would run
ETCD_HOST_OFFSET = 10  # AWS reserves the first four addresses of a subnet; .10 is easy to recognise
MIN_AZS = 2


@dataclass(frozen=True)
class SubnetPlan:
    az: str
    cidr: str


@dataclass(frozen=True)
class NetworkPlan:
    vpc_cidr: str
    subnets: tuple[SubnetPlan, ...]
    etcd_ip: str  # fixed private address of the etcd host's network interface, in subnets[0]

    @property
    def azs(self) -> list[str]:
        return [s.az for s in self.subnets]


def plan_network(azs: list[str], vpc_cidr: str = DEFAULT_VPC_CIDR, max_azs: int = 3) -> NetworkPlan:
    """One public subnet per AZ (sorted, at most `max_azs`), carved in order from `vpc_cidr`.

    Spot capacity differs per AZ, so more AZs mean fewer interruptions; two is the floor because an
    Auto Scaling group in a single AZ cannot rebalance away from a capacity shortage there.
    """
    chosen = sorted(set(azs))[:max_azs]
    if len(chosen) < MIN_AZS:
        raise ProviderError(f"the region offers {len(chosen)} usable availability zone(s); petctl needs "
                            f"at least {MIN_AZS}")
    try:
        vpc = ipaddress.ip_network(vpc_cidr)
    except ValueError as exc:
        raise ValidationError(f"invalid VPC CIDR {vpc_cidr!r}: {exc}") from None
    if vpc.version != 4 or vpc.prefixlen > SUBNET_PREFIX - 2:
        raise ValidationError(f"VPC CIDR {vpc_cidr} is too small: use an IPv4 /{SUBNET_PREFIX - 2} or larger")
    blocks = vpc.subnets(new_prefix=SUBNET_PREFIX)
    subnets = tuple(SubnetPlan(az=az, cidr=str(next(blocks))) for az in chosen)
    first = ipaddress.ip_network(subnets[0].cidr)
    etcd_ip = str(first.network_address + ETCD_HOST_OFFSET)
    return NetworkPlan(vpc_cidr=str(vpc), subnets=subnets, etcd_ip=etcd_ip)
