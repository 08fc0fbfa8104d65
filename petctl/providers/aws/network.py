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
ETCD_NODE_CHOICES = (1, 3)  # one host that heals itself, or a cluster that survives losing any one member
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
SUBNET_KINDS = ("public", "private")
# What instances in private subnets (no public address, no internet gateway) reach through VPC interface
# endpoints. S3 already has its gateway endpoint (free). Each service, and who calls it:
INTERFACE_ENDPOINTS = (
    "ecr.api",  # the worker's boot: ECR GetAuthorizationToken (docker login)
    "ecr.dkr",  # the worker's boot: docker pull (the layers themselves come from S3)
    "logs",  # the agent container's awslogs driver
    "ssm",  # Session Manager: the SSM agent registers (UpdateInstanceInformation)
    "ssmmessages",  # Session Manager: the session channels
    "autoscaling",  # lifecycle actions, SetInstanceHealth, the job's release
    "ec2",  # the etcd hosts claim their fixed-address network interface
)


@dataclass(frozen=True)
class SubnetPlan:
    az: str
    cidr: str


@dataclass(frozen=True)
class EtcdMember:
    """One etcd member: its fixed name, its fixed address (on a network interface of its own) and the
    subnet (index into NetworkPlan.subnets) its interface and its one-instance group live in."""

    name: str
    ip: str
    subnet: int

    @property
    def client_url(self) -> str:
        return f"http://{self.ip}:{ETCD_CLIENT_PORT}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.ip}:{ETCD_PEER_PORT}"


@dataclass(frozen=True)
class NetworkPlan:
    vpc_cidr: str
    subnets: tuple[SubnetPlan, ...]
    etcd_members: tuple[EtcdMember, ...]
    private: bool = False  # private subnets and interface endpoints instead of public addresses

    @property
    def interface_endpoints(self) -> tuple[str, ...]:
        """The interface endpoints the stack needs: none with public subnets."""
        return INTERFACE_ENDPOINTS if self.private else ()

    @property
    def azs(self) -> list[str]:
        return [s.az for s in self.subnets]

    @property
    def etcd_ip(self) -> str:
        """The first member's address (the only one with one etcd host)."""
        return self.etcd_members[0].ip

    @property
    def etcd_endpoint(self) -> str:
        """What agents are given: every member's client URL, comma-separated."""
        return ",".join(m.client_url for m in self.etcd_members)

    @property
    def etcd_cluster(self) -> bool:
        return len(self.etcd_members) > 1

    @property
    def etcd_azs(self) -> int:
        """How many AZs the etcd members are spread over."""
        return len({m.subnet for m in self.etcd_members})


def plan_network(azs: list[str], vpc_cidr: str = DEFAULT_VPC_CIDR, max_azs: int = 3,
                 etcd_nodes: int = 1, private: bool = False) -> NetworkPlan:
    """One subnet per AZ (sorted, at most `max_azs`), carved in order from `vpc_cidr`, and the etcd
    members' fixed addresses: member i in subnet i mod (number of subnets), at offset 10 (11 for a second
    member in the same subnet). With 3 members and only 2 AZs two members share an AZ: losing any one
    instance is still no outage, losing that whole AZ is (the docs say so; setup reports it).

    Spot capacity differs per AZ, so more AZs mean fewer interruptions; two is the floor because an
    Auto Scaling group in a single AZ cannot rebalance away from a capacity shortage there. The subnets
    are public (instances get a public IPv4 address, $0.005/h each) or, with `private`, private: no
    public address, no internet gateway, AWS's APIs reached through INTERFACE_ENDPOINTS. Raises
    ValidationError for an etcd_nodes other than 1 or 3.
    """
    if etcd_nodes not in ETCD_NODE_CHOICES:
        raise ValidationError(f"--etcd-nodes must be 1 or 3 (got {etcd_nodes})")
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
    members = []
    for i in range(etcd_nodes):
        subnet = i % len(subnets)
        base = ipaddress.ip_network(subnets[subnet].cidr).network_address
        name = "petctl" if etcd_nodes == 1 else f"petctl-{i}"  # the single host's name predates clusters
        members.append(EtcdMember(name, str(base + ETCD_HOST_OFFSET + i // len(subnets)), subnet))
    return NetworkPlan(vpc_cidr=str(vpc), subnets=subnets, etcd_members=tuple(members), private=private)
