"""Dependencies CloudFormation cannot see (issue 11, item 6). CloudFormation orders creation and deletion
by Ref/GetAtt/Sub and DependsOn only. A resource that reaches another one any other way (a boot script
that finds an interface by its tags or its address, a literal name) needs an explicit DependsOn, or a
stack deletion removes the target while it is still in use (an attached interface: DELETE_FAILED).

The scan is generic: every resource's user data (boot scripts) is searched for the identity of
every other resource (its fixed address, its name, or the tags a boot script filters on), and whoever
launches instances from such user data must depend on the target, directly or transitively.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.aws import rendered
from tests.aws.rendered import parse

DESCRIBE_TYPES = {"describe-network-interfaces": "AWS::EC2::NetworkInterface",
                  "describe-instances": "AWS::EC2::Instance", "describe-volumes": "AWS::EC2::Volume"}
NAME_PROPERTIES = ("PrivateIpAddress", "LaunchTemplateName", "AutoScalingGroupName", "RoleName",
                   "LogGroupName", "RepositoryName", "BucketName", "InstanceProfileName")


def explicit_dependencies(resource: dict[str, Any], names: set[str]) -> set[str]:
    """What CloudFormation itself sees: Ref, Fn::GetAtt, ${X} in Fn::Sub, DependsOn."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "Ref" and value in names:
                    found.add(value)
                elif key == "Fn::GetAtt":
                    target = value[0] if isinstance(value, list) else str(value).split(".")[0]
                    found.add(target)
                elif key == "Fn::Sub":
                    text = value[0] if isinstance(value, list) else value
                    found.update(n.split(".")[0] for n in re.findall(r"\$\{([^}!]+)\}", text)
                                 if n.split(".")[0] in names)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(resource.get("Properties", {}))
    depends = resource.get("DependsOn", [])
    found.update([depends] if isinstance(depends, str) else depends)
    return found


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = list(graph.get(start, ()))
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return seen


def user_data(node: Any, shipped: dict[str, str] | None = None) -> list[str]:
    """The boot scripts a resource carries (UserData anywhere in its properties), and the scripts that
    user data fetches from the bucket by key (`shipped`: key -> text; the etcd hosts' stubs)."""
    if isinstance(node, dict):
        texts = [t for key, value in node.items()
                 for t in (strings(value) if key == "UserData" else user_data(value, shipped))]
    elif isinstance(node, list):
        texts = [t for item in node for t in user_data(item, shipped)]
    else:
        return []
    return texts + [script for key, script in (shipped or {}).items() if any(key in t for t in texts)]


def strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings(value)]
    if isinstance(node, list):
        return [s for item in node for s in strings(item)]
    return []


def tag_lookups(text: str) -> list[tuple[str, dict[str, str]]]:
    """`aws ec2 describe-X --filters Name=tag:K,Values=V ...` commands: (resource type, tag filters)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lookups = []
    for line in joined.splitlines():
        for command, kind in DESCRIBE_TYPES.items():
            if command in line:
                tags = {k: v.strip("'\"") for k, v in re.findall(r"Name=tag:([^,\s]+),Values=(\S+)", line)}
                if tags:
                    lookups.append((kind, tags))
    return lookups


def hidden_references(template: dict[str, Any], shipped: dict[str, str] | None = None) -> dict[str, set[str]]:
    """resource -> the resources it reaches without CloudFormation seeing it."""
    resources = template["Resources"]
    hidden: dict[str, set[str]] = {}
    for name, resource in resources.items():
        texts = user_data(resource.get("Properties", {}), shipped)
        for other, target in resources.items():
            if other == name:
                continue
            props = target.get("Properties", {})
            identities = [str(props[p]) for p in NAME_PROPERTIES if isinstance(props.get(p), str)]
            tags = {t["Key"]: t["Value"] for t in props.get("Tags", []) if isinstance(t, dict)
                    and isinstance(t.get("Value"), str)}
            by_name = any(identity in text for identity in identities for text in texts)
            by_tags = any(kind == target["Type"] and all(tags.get(k) == v for k, v in wanted.items())
                          for text in texts for kind, wanted in tag_lookups(text))
            if by_name or by_tags:
                hidden.setdefault(name, set()).add(other)
    return hidden


def launchers(template: dict[str, Any], launch_template: str) -> list[str]:
    """The groups/instances whose instances boot from `launch_template` (and so run its user data)."""
    return [name for name, r in template["Resources"].items()
            if r["Type"] in ("AWS::AutoScaling::AutoScalingGroup", "AWS::EC2::Instance")
            and launch_template in explicit_dependencies(r, set(template["Resources"]))]


def missing_dependencies(template: dict[str, Any], shipped: dict[str, str] | None = None) -> list[str]:
    resources = template["Resources"]
    graph = {name: explicit_dependencies(r, set(resources)) for name, r in resources.items()}
    missing = []
    for holder, targets in hidden_references(template, shipped).items():
        users = launchers(template, holder) if resources[holder]["Type"] == "AWS::EC2::LaunchTemplate" else []
        for user in users or [holder]:
            for target in targets - {user}:
                if target not in closure(graph, user) and user not in closure(graph, target):
                    missing.append(f"{user} reaches {target} (through {holder}) without a DependsOn")
    return sorted(missing)


def shipped(etcd_nodes: int = 1) -> dict[str, str]:
    script = rendered.etcd_boot_script(etcd_nodes)
    return {script.key: script.text}


def test_etcd_group_waits_for_and_outlives_nothing_of_its_interface():
    base = parse(rendered.base_template())
    scripts = shipped()
    # the scan reads the boot script the stub fetches, and sees the interface lookup in it
    assert "EtcdNetworkInterface" not in hidden_references(base).get("EtcdLaunchTemplate", set())
    assert "EtcdNetworkInterface" in hidden_references(base, scripts)["EtcdLaunchTemplate"]
    assert "EtcdNetworkInterface" in closure(
        {n: explicit_dependencies(r, set(base["Resources"])) for n, r in base["Resources"].items()},
        "EtcdGroup")
    assert missing_dependencies(base, scripts) == []


@pytest.mark.parametrize("variant", sorted(rendered.JOB_VARIANTS))
def test_job_stack_has_no_hidden_dependency(tmp_path, variant):
    script = rendered.job_boot_script(tmp_path, variant)  # what the workers' user data fetches
    template = parse(rendered.job_template(tmp_path, variant))
    assert script.key in json.dumps(template)
    assert missing_dependencies(template, {script.key: script.text}) == []


def test_the_scan_catches_a_missing_depends_on():
    base = parse(rendered.base_template())
    del base["Resources"]["EtcdGroup"]["DependsOn"]
    # The etcd role's policy names its interface by ARN (a dependency CloudFormation sees, through the
    # launch template's instance profile): without it, only the DependsOn would order the two.
    assert missing_dependencies(base, shipped()) == []
    statements = base["Resources"]["EtcdRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
    (own,) = [s for s in statements if s["Sid"] == "AttachOwnInterface"]
    own["Resource"] = "*"
    assert missing_dependencies(base, shipped()) == [
        "EtcdGroup reaches EtcdNetworkInterface (through EtcdLaunchTemplate) without a DependsOn"]
