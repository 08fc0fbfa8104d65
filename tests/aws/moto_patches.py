"""Test-only patches of moto's CloudFormation emulation. Nothing in petctl imports this module.

moto's CloudFormation deletes only resources whose model implements deletion; a route table, an internet
gateway (and its VPC attachment), a gateway VPC endpoint and a network interface are left behind, so the
VPC that holds them cannot be deleted and `delete_stack` of the base stack fails with DependencyViolation.
Real CloudFormation deletes all of them in dependency order. The patch does what CloudFormation would,
right before moto deletes the VPC: it removes those leftovers *of that VPC only*.

moto also ignores `EmptyOnDelete: true` on an `AWS::ECR::Repository` (CloudFormation deletes the images
with the repository); the second patch honours that property for repositories that set it.

moto's `AWS::EC2::SecurityGroupIngress` has no deletion: a rule a job stack puts on the base stack's etcd
group would outlive the job. CloudFormation revokes it with the stack; the third patch does, also when
moto (in no dependency order) deleted the job's own group, the rule's source, first.
"""

from __future__ import annotations

import contextlib


def _clear_vpc_leftovers(backend, vpc_id: str) -> None:
    for table in list(backend.route_tables.values()):
        if table.vpc_id != vpc_id or table.main_association_id:
            continue
        for association_id in list(table._associations):
            backend.disassociate_route_table(association_id)
        backend.delete_route_table(table.id)
    for igw in list(backend.internet_gateways.values()):
        if igw.vpc and igw.vpc.id == vpc_id:
            backend.detach_internet_gateway(igw.id, vpc_id)
            backend.delete_internet_gateway(igw.id)
    endpoints = [e.id for e in backend.vpc_end_points.values() if e.vpc_id == vpc_id]
    backend.delete_vpc_endpoints(endpoints)
    for eni in list(backend.enis.values()):
        if eni.subnet.vpc_id == vpc_id and eni.instance is None:
            backend.delete_network_interface(eni.id)


def patch_moto_stack_deletion() -> None:
    """Idempotent; call once in the process that runs moto's server."""
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.vpcs import VPC

    if getattr(VPC, "_petctl_patched", False):
        return
    original = VPC.delete_from_cloudformation_json.__func__

    def delete_from_cloudformation_json(cls, resource_name, cloudformation_json, account_id, region_name):
        with contextlib.suppress(Exception):
            _clear_vpc_leftovers(ec2_backends[account_id][region_name], resource_name)
        return original(cls, resource_name, cloudformation_json, account_id, region_name)

    VPC.delete_from_cloudformation_json = classmethod(delete_from_cloudformation_json)
    VPC._petctl_patched = True
    _patch_ecr_empty_on_delete()
    _patch_security_group_ingress_deletion()


def _patch_security_group_ingress_deletion() -> None:
    from moto.ec2.exceptions import InvalidSecurityGroupNotFoundError
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.security_groups import SecurityGroupIngress

    def delete(self, account_id: str, region_name: str) -> None:
        props = self.properties
        source = {"GroupId": props["SourceSecurityGroupId"]} if props.get("SourceSecurityGroupId") else None
        backend = ec2_backends[account_id][region_name]
        try:
            backend.revoke_security_group_ingress(
                group_name_or_id=self.security_group.id, ip_protocol=props["IpProtocol"],
                from_port=props.get("FromPort"), to_port=props.get("ToPort"),
                ip_ranges=[{"CidrIp": props["CidrIp"]}] if props.get("CidrIp") else [],
                source_groups=[source] if source else [])
        except InvalidSecurityGroupNotFoundError:
            _drop_rules_from(backend, self.security_group.id, props.get("SourceSecurityGroupId"))

    SecurityGroupIngress.delete = delete


def _drop_rules_from(backend, group_id: str, source_id: str | None) -> None:
    """moto deletes a stack's resources in no dependency order, so the job's own group may be gone before
    the rule that admits it to etcd's group (CloudFormation deletes the rule first: it refers to the
    group); moto's revoke then fails on the missing source. Drop the rules that still name it."""
    for groups in backend.groups.values():  # keyed by VPC, then group id
        target = groups.get(group_id)
        if target is not None and source_id:
            target.ingress_rules = [rule for rule in target.ingress_rules
                                    if rule.source_group.get("GroupId") != source_id]


def _patch_ecr_empty_on_delete() -> None:
    from moto.ecr.models import Repository, ecr_backends

    create = Repository.create_from_cloudformation_json.__func__

    def create_from_cloudformation_json(cls, resource_name, cloudformation_json, account_id, region_name,
                                        **kwargs):
        repo = create(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs)
        properties = cloudformation_json.get("Properties", {})
        repo._petctl_empty_on_delete = str(properties.get("EmptyOnDelete", "false")).lower() == "true"
        return repo

    def delete(self, account_id: str, region_name: str) -> None:
        force = getattr(self, "_petctl_empty_on_delete", False)
        ecr_backends[account_id][region_name].delete_repository(self.name, force=force)

    Repository.create_from_cloudformation_json = classmethod(create_from_cloudformation_json)
    Repository.delete = delete


def record_lifecycle_actions(monkeypatch) -> list[dict[str, str]]:
    """moto has no CompleteLifecycleAction (an unknown action to it), and its CloudFormation ignores an
    Auto Scaling group's `LifecycleHookSpecificationList`. For the test that uses `monkeypatch` (both
    undone with it): a group created by a stack gets the hooks its template declares, as CloudFormation
    creates them; and CompleteLifecycleAction is checked as AWS's API reference states: the group must
    exist and have that hook, the instance must be in the group, the result must be CONTINUE or ABANDON
    (else a ValidationError, as AWS answers). Each accepted call is appended to the list returned, for
    the test to assert on; what the result then does (an instance leaving Pending:Wait, or ABANDON
    terminating it) is not modelled: moto's instances are in service from launch."""
    from moto.autoscaling.exceptions import ValidationError
    from moto.autoscaling.models import FakeAutoScalingGroup, autoscaling_backends
    from moto.autoscaling.responses import AutoScalingResponse, EmptyResult

    create_group = FakeAutoScalingGroup.create_from_cloudformation_json

    def create_with_hooks(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs):
        group = create_group(resource_name, cloudformation_json, account_id, region_name, **kwargs)
        for hook in cloudformation_json["Properties"].get("LifecycleHookSpecificationList", []):
            autoscaling_backends[account_id][region_name].create_lifecycle_hook(
                name=hook["LifecycleHookName"], as_name=group.name, transition=hook["LifecycleTransition"],
                timeout=hook.get("HeartbeatTimeout"), result=hook.get("DefaultResult", "ABANDON"))
        return group

    monkeypatch.setattr(FakeAutoScalingGroup, "create_from_cloudformation_json",
                        classmethod(create_with_hooks))

    calls: list[dict[str, str]] = []

    def complete_lifecycle_action(self):
        call = {name: self._get_param(name) or "" for name in ("AutoScalingGroupName", "LifecycleHookName",
                                                                "InstanceId", "LifecycleActionResult")}
        backend = self.autoscaling_backend
        group = backend.autoscaling_groups.get(call["AutoScalingGroupName"])
        if group is None:
            raise ValidationError(f"Group {call['AutoScalingGroupName']} not found")
        hooks = backend.describe_lifecycle_hooks(call["AutoScalingGroupName"], [call["LifecycleHookName"]])
        if not hooks:
            raise ValidationError(f"No Lifecycle Hook found with name {call['LifecycleHookName']}")
        if call["InstanceId"] not in {state.instance.id for state in group.instance_states}:
            raise ValidationError(f"No active Lifecycle Action found with instance ID {call['InstanceId']}")
        if call["LifecycleActionResult"] not in ("CONTINUE", "ABANDON"):
            raise ValidationError("LifecycleActionResult must be CONTINUE or ABANDON")
        calls.append(call)
        return EmptyResult()

    monkeypatch.setattr(AutoScalingResponse, "complete_lifecycle_action", complete_lifecycle_action,
                        raising=False)
    return calls
